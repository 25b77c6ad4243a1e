"""The routed experts of a decode token as one launch (`MoeTiles.one_launch`, tilings "pairs-n8-one" and
"pairs-n8-one-pf": `moe_pair_layer_fwd_kernel`): the split router, gemm1 with its own top-k, gemm2 and the combine,
ordered by counters inside the launch instead of by three launch boundaries. Each program draws its place from a
counter when it starts, so it only ever waits on programs that started before it (no deadlock whatever order the
hardware starts them in). The results must be the three-launch path's ("pairs-n8-fc-g1"), bit for bit: the same
helpers on the same tiles.

CPU: the kernel under TRITON_INTERPRET=1 at tiny shapes (fresh random inputs) vs the three-launch path
(`torch.equal`) and vs the fp64 `moe_sorted`; the interpreter runs programs one after another in place order, so it
checks the arithmetic and the counter bookkeeping, not concurrency. Its sm_90 build: the waits are polled acquire
loads, the selection and GEMV reductions have the separate kernels' layouts, the w2 prefetch is there. GPU: bit
identity over repeated calls and CUDA-graph replays at k3-small and K3 shapes (a race would show as a differing
call).

Error = max |kernel - reference| / max |reference| on the same inputs.
"""

from __future__ import annotations

import json
import os
import re

if __name__ == "__main__":  # the interpreter run (see `interp` in conftest.py): the flag must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from k3export.plugins.moe.naive import moe_sorted
from test_moe_kernels import BF16_BOUND, FP16_BOUND, FP32_BOUND, SITU, _rel, _weights   # bounds with their reasons
from test_moe_pairs_fused import SHAPES, _clear_rows, _inputs, _reduce_layouts, _tickets_zero, _ttgir

THREE, ONE, ONE_PF = "pairs-n8-fc-g1", "pairs-n8-one", "pairs-n8-one-pf"


def _moe(x, z, w, k, tiling, scaling=2.5):
    from k3export.plugins.moe.kernels import TILINGS, moe_routed_fwd
    return moe_routed_fwd(x, z, *w, k, True, scaling, tiles=TILINGS["decode"][tiling], **SITU)


def _one(x, z, w, k, tiling, scaling=2.5):
    """(u, ids, w, s) of the one-launch path."""
    from k3export.plugins.moe.kernels import TILINGS, pairs_layer_fwd
    return pairs_layer_fwd(x, z, *w, k, True, scaling, cfg=TILINGS["decode"][tiling], **SITU)


def _same_as_three(x, z, w, k, tiling, scaling=2.5) -> bool:
    """The one-launch outputs == the three-launch path's u and `route_fwd`'s ids, weights and scores."""
    from k3export.plugins.moe.kernels import route_fwd
    u, ids, wt, s = _one(x, z, w, k, tiling, scaling)
    routed = route_fwd(x, w[0], w[1], k, True, scaling, True)
    return torch.equal(u, _moe(x, z, w, k, THREE, scaling)) and all(
        torch.equal(p, q) for p, q in zip((ids, wt, s), routed))


def _interpreter_cases() -> dict:
    """Every CPU case, run in this process under TRITON_INTERPRET=1 -> {case: relative error or flag}."""
    res = {}
    # E 20, d 300 (3 of the router's 8 splits of 128 (fp16) / 5 of 64 (fp32) hold columns), L 24 over 3 gemm2 tiles
    # of 8 (several combine tickets per token), I 16 over 2 gemm1 tiles of 8.
    E, d, L, I = 20, 300, 24, 16
    for name, dt in (("fp32", torch.float32), ("fp16", torch.float16)):
        torch.manual_seed(0)
        w = _weights(E, d, L, I, dt)
        w64 = [t.double() for t in w]
        w64[1] = w[1]
        for N in (1, 2):
            for k in (2, 8):
                x, z = torch.randn(N, d, dtype=dt), torch.randn(N, L, dtype=dt)
                case = f"{name}-n{N}-k{k}"
                res[f"equal-{case}"] = float(_same_as_three(x, z, w, k, ONE) and _same_as_three(x, z, w, k, ONE_PF)
                                             and torch.equal(_moe(x, z, w, k, ONE), _one(x, z, w, k, ONE)[0]))
                ref = moe_sorted(x.double(), z.double(), *w64, k, True, 2.5, **SITU)
                res[f"ref-{case}"] = _rel(_one(x, z, w, k, ONE)[0], ref)
    # Ties (experts 2j, 2j+1 copies, 4 and 5 hot): the same ids as the top-k kernel, lower id first.
    torch.manual_seed(1)
    w = list(_weights(E, d, L, I, torch.float32))
    for t in w:
        t[1::2] = t[0::2]
    w[1][4] = w[1][5] = 100.0
    ties = []
    for N in (1, 2):
        x, z = torch.randn(N, d), torch.randn(N, L)
        ties.append(_same_as_three(x, z, w, 8, ONE) and bool((_one(x, z, w, 8, ONE)[1][:, :2]
                                                              == torch.tensor([4, 5])).all()))
    res["ties-equal"] = float(all(ties))
    # Consecutive calls on fresh inputs (every counter back at 0 after each), then all counters 0.
    torch.manual_seed(2)
    w = _weights(E, d, L, I, torch.float16)
    res["consecutive-equal"] = float(all(_same_as_three(torch.randn(2, d, dtype=torch.float16),
                                                        torch.randn(2, L, dtype=torch.float16), w, 8, ONE)
                                         for _ in range(3)))
    res["tickets-zero"] = float(_tickets_zero())
    return res


@pytest.mark.parametrize("case", [f"equal-{dt}-n{n}-k{k}" for dt in ("fp32", "fp16") for n in (1, 2) for k in (2, 8)]
                         + ["ties-equal", "consecutive-equal", "tickets-zero"])
def test_interpreted_one_launch_bit_identical(interp, case):
    assert interp[case] == 1.0, interp


@pytest.mark.parametrize("dt,bound", [("fp32", FP32_BOUND), ("fp16", FP16_BOUND)])
def test_interpreted_one_launch_vs_reference(interp, dt, bound):
    errs = {c: v for c, v in interp.items() if c.startswith(f"ref-{dt}-")}
    assert len(errs) == 4 and max(errs.values()) < bound, errs


def test_one_launch_only_where_it_applies():
    """The tiling routes a call to the one launch only on the pairs path with a split router (few tokens, at most
    TOPK_GEMM1_MAX_E experts); the selection stays the three-launch path's otherwise (its own arguments)."""
    from k3export.plugins.moe.kernels import TILINGS, TOPK_GEMM1_MAX_E
    one = TILINGS["decode"][ONE]
    three = TILINGS["decode"][THREE]
    assert one.one_launch and not three.one_launch and one.topk_gemm1 == three.topk_gemm1 and one.fuse_combine
    assert TILINGS["decode"][ONE_PF].w2_l2 and not one.w2_l2
    assert one.pair_gemm == three.pair_gemm and TOPK_GEMM1_MAX_E == 64


# ---------------------------------------------------------------------------------------------- sm_90 compile
def _layer_sig() -> dict:
    i32 = "i32"
    sig = {"x": "*bf16", "g": "*bf16", "bias": "*fp32", "part": "*fp32", "s": "*fp32", "ids": "*i32", "wt": "*fp32",
           "z": "*bf16", "w1": "*bf16", "w3": "*bf16", "h": "*bf16", "w2": "*bf16", "y": "*fp32", "u": "*bf16",
           "tickets": "*i32"}
    sig.update({n: i32 for n in ("N", "E", "D", "L", "I", "stride_xn", "stride_ge", "D_SPLIT", "stride_zn",
                                 "stride_we1", "stride_wi", "stride_h", "stride_we2", "stride_wl", "stride_y",
                                 "stride_u")})
    sig.update(scaling="fp32", beta="fp32", linear_beta="fp32")
    return sig


def _layer_kernel(E: int, k: int, w2_lines: int):
    from k3export.plugins.moe import kernels as K
    from k3export.plugins.triton_common import pow2
    (bn1, bk1, _), (bn2, bk2, _) = K.TILINGS["decode"][ONE].pair_gemm
    return _ttgir(K.moe_pair_layer_fwd_kernel, _layer_sig(),
                  dict(TOP_K=k, SPLITS=8, BLOCK_RM=16, BLOCK_RE=16, BLOCK_D=128, DOT_PREC="tf32", BLOCK_E=pow2(E),
                       BLOCK_TK=pow2(k, 2), RENORM=True, PACKED=True, BLOCK_N1=bn1, BLOCK_K1=bk1, BLOCK_N2=bn2,
                       BLOCK_K2=bk2, W2_LINES=w2_lines))


@pytest.mark.parametrize("E,k", [(896, 16), (64, 8)])
def test_one_launch_compiles_sm90(E, k):
    """sm_90 PTX: every wait (router done, the token's first pair, the pair itself) is a polled
    `ld.global.gpu.acquire` (an unused acquire add would be removed, leaving no ordering), the phases hand over
    with release adds (`red` where the compiler drops the unused result), the place counter is a relaxed add, and
    the w2 prefetch is there only when asked for. Its
    selection reductions are the top-k kernel's and its gemm2 row sum is the separate gemm2's (same shapes and
    layouts: the same bits on the GPU)."""
    from k3export.plugins.moe import kernels as K
    from k3export.plugins.triton_common import pow2
    kern = _layer_kernel(E, k, 128)
    ptx = kern.asm["ptx"]
    assert ptx.count("ld.global.gpu.acquire.b32") == 3, ptx[-3000:]
    assert len(re.findall(r"(?:atom|red)\.global\.gpu\.release\.add", ptx)) == 2   # triton 3.9: red (result unused)
    assert ptx.count("atom.global.gpu.relaxed.add") == 1
    assert ptx.count("atom.global.gpu.acq_rel.add") == 2                  # the combine ticket, the last program
    assert "prefetch.global.L2" in ptx and "prefetch.global.L2" not in _layer_kernel(E, k, 0).asm["ptx"]
    topk = _reduce_layouts(_ttgir(K.moe_topk_fwd_kernel, {"s": "*fp32", "part": "*fp32", "bias": "*fp32",
                                                          "ids": "*i32", "w": "*fp32", "N": "i32", "E": "i32",
                                                          "scaling": "fp32"},
                                  dict(K=k, BLOCK_K=pow2(k, 2), RENORM=True, PACKED=True, BLOCK_E=pow2(E), SPLITS=8)))
    bn, bk, _ = K.TILINGS["decode"][ONE].pair_gemm[1]
    rest = {"L": "i32", "I": "i32", "stride_h": "i32", "stride_we": "i32", "stride_wl": "i32", "stride_y": "i32"}
    gemm2 = _reduce_layouts(_ttgir(K.moe_pair_gemm2_fwd_kernel, {"h": "*bf16", "w2": "*bf16", "y": "*fp32",
                                                                 "ids": "*i32", **rest}, dict(BLOCK_N=bn, BLOCK_K=bk)))
    layer = _reduce_layouts(kern)
    assert layer[:len(topk)] == topk, (layer, topk)             # the gemm1 phase's selection (first in the code)
    assert gemm2[0] in layer[len(topk):], (layer, gemm2)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def experts():
    """shape name -> random routed experts in bf16 (K3: 59 GB), built once per name for the GPU tests."""
    cache = {}

    def get(name):
        if name not in cache:
            E, d, L, I, _ = SHAPES[name]
            if E > 64:                       # the one launch serves up to TOPK_GEMM1_MAX_E experts: K3 at 64 of them
                E = 64
            gen = torch.Generator(device="cuda").manual_seed(17)
            cache[name] = _weights(E, d, L, I, torch.bfloat16, "cuda", gen)
        return cache[name]
    yield get
    cache.clear()
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.parametrize("tiling", [ONE, ONE_PF])
@pytest.mark.parametrize("name", ["k3", "k3-small"])
@pytest.mark.parametrize("N", [1, 2])
def test_one_launch_gpu_bit_identical(experts, name, N, tiling):
    """One launch == three launches (u, ids, w, s: bit for bit) over 10 calls each on fresh inputs, and within the
    bf16 bound of moe_sorted on clear rows. "k3": K3's d, L, I and top-16 over 64 experts."""
    w = experts(name)
    k = SHAPES[name][4]
    for seed in range(10):
        x, z = _inputs(name, N, 1000 * N + seed)
        assert _same_as_three(x, z, w, k, tiling, 1.0), (name, N, seed)
    assert _tickets_zero()
    u = _one(x, z, w, k, tiling, 1.0)[0]
    clear = _clear_rows(x, w[0], w[1], k)
    ref = moe_sorted(x, z, *w, k, True, 1.0, **SITU)
    err = ((u.double() - ref.double())[clear].abs().max() / ref.double().abs().max()).item() if clear.any() else 0.0
    print(f"one launch {tiling} {name} N={N}: rel err vs moe_sorted {err:.2e} on {int(clear.sum())}/{N} clear rows")
    assert err < BF16_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("tiling", [ONE, ONE_PF])
@pytest.mark.parametrize("N", [1, 2])
def test_one_launch_gpu_cuda_graph(experts, N, tiling):
    """The one launch captured in a CUDA graph (after a warm-up call, as a decode step is) and replayed 5 times on
    fresh inputs copied into the captured buffers: each replay == the three-launch path on those inputs, bit for
    bit (the counters go back to 0 inside every replay)."""
    w = experts("k3-small")
    k = SHAPES["k3-small"][4]
    x, z = _inputs("k3-small", N, 7)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _moe(x, z, w, k, tiling, 1.0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        u = _moe(x, z, w, k, tiling, 1.0)
    for seed in range(5):
        xn, zn = _inputs("k3-small", N, 100 + seed)
        x.copy_(xn)
        z.copy_(zn)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(u, _moe(xn, zn, w, k, THREE, 1.0)), (N, seed)
    assert _tickets_zero()


@pytest.mark.cuda
def test_one_launch_gpu_compile_tokens(monkeypatch):
    """k3-small bf16 through one `compile` backend, 2 prompts' prefill then 8 greedy decode steps at B = 1 (CUDA
    graph), with the default tiling twice and with K3_MOE_DECODE=pairs-n8-one-pf (read at each MoE call, so at
    the decode graph's capture): the same tokens, and logits within the run-to-run difference of the two default
    runs (0 if the step is deterministic: then bit-identical)."""
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    from k3export.runtime import CompileBackend, Engine
    model = random_model(K3Config.from_name("k3-small"), seed=0, dtype=torch.bfloat16, device="cuda")
    prompt = [torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()]
    backend = CompileBackend(model)

    def run(tiling: str) -> list[torch.Tensor]:
        if tiling:
            monkeypatch.setenv("K3_MOE_DECODE", tiling)
        else:
            monkeypatch.delenv("K3_MOE_DECODE", raising=False)
        eng = Engine(backend, max_batch=1, max_len=64)
        assert eng.graphed, eng.graph_error
        logits = [eng.prefill([0], prompt).float()]
        for _ in range(8):
            logits.append(eng.decode(logits[-1].argmax(-1)).float().clone())
        return logits

    base, again, one = run(""), run(""), run(ONE_PF)
    for step, (a, b, c) in enumerate(zip(base, again, one)):
        spread = (a - b).abs().max().item()
        assert torch.equal(a.argmax(-1), c.argmax(-1)), step
        assert (a - c).abs().max().item() <= spread, (step, spread)



if __name__ == "__main__":
    print(json.dumps(_interpreter_cases()))
