"""`k3::gemv` (plugins/gemv): the one-row decode GEMV whose weight rows are loaded before the PDL wait, and the
swap that puts it under the model's linears (`packing.gemv_linears`).

CPU: the kernel in the Triton interpreter vs fp64 on fresh random inputs (rows not a multiple of the tile, K not a
power of two, several x rows, strided x); the sm_90 PTX has the weight loads before `griddepcontrol.wait` and the
x loads after it; the op's reference and fake; the class swap (packed linears included) leaves parameters and
`state_dict` alone and is undone by `unpacked` / `unpack_projections`; CPU models keep cuBLAS-free F.linear.
GPU (`cuda`): k3-small and K3 decode shapes vs fp64; a CUDA graph of chained GEMVs with PDL (outputs zeroed
first, so an early read of x would show) equal bit for bit to the plain launches; k3-small through the compile
backend (GEMV + PDL) gives eager's greedy tokens on k3-tiny fp32 at B = 1; every GEMV call of a k3-small decode
step within one bf16 ulp of cuBLAS's output."""

from __future__ import annotations

import json
import os
import re

if __name__ == "__main__":  # the interpreter run (conftest `interp`): the flag must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from torch import nn

from k3export.plugins.gemv import kernels as G

BF16_ULP = 2.0 ** -7     # one bf16 ulp relative to the value: the interpreter rounds fp32 -> bf16 toward zero


def _ref(x, w):
    return x.double() @ w.double().t()


def _inputs(M, N, K, dtype, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device).to(dtype)
    w = (torch.randn(N, K, generator=g, device=device) * K ** -0.5).to(dtype)
    return x, w


def _check(y, x, w, rel):
    assert _worst(y, x, w, rel) <= 1.0, f"an output is beyond {rel:.1e} of its value"
    r = _ref(x, w)
    return ((y.double() - r).abs().max() / r.abs().max()).item()


# ---------------------------------------------------------------------------------------------- interpreter
CASES = [(1, 300, 200, torch.bfloat16), (1, 2048, 1792, torch.bfloat16), (3, 64, 768, torch.float32),
         (2, 17, 8192, torch.float16)]


def _bound(dtype) -> float:
    return 1e-6 if dtype == torch.float32 else BF16_ULP if dtype == torch.bfloat16 else 2.0 ** -10


def _interpreter_cases() -> dict:
    """Every CPU kernel case, run in this process under TRITON_INTERPRET=1 -> {case: max error / its bound}."""
    res = {}
    for M, N, K, dtype in CASES:
        x, w = _inputs(M, N, K, dtype, seed=M * N + K)
        y = G.gemv_fwd(x, w)
        assert y.shape == (M, N) and y.dtype == dtype
        res[f"{M}x{N}x{K}-{dtype}"] = _worst(y, x, w, _bound(dtype))
    x, w = _inputs(2, 96, 256, torch.bfloat16, seed=3)
    wide = torch.randn(2, 300).to(torch.bfloat16)
    wide[:, 10:266] = x
    res["strided"] = _worst(G.gemv_fwd(wide[:, 10:266], w), x, w, BF16_ULP)          # rows 300 apart
    y3 = G.gemv_fwd(x.view(2, 1, 256), w)
    res["leading_dims"] = 0.0 if y3.shape == (2, 1, 96) and torch.equal(y3.view(2, 96), G.gemv_fwd(x, w)) else 9.0
    for M, dtype in ((2, torch.bfloat16), (3, torch.float32), (4, torch.float16)):  # x rows in one batch vs in turn
        x, w = _inputs(M, 40, 300, dtype, seed=M)
        batched, turn = G.gemv_fwd(x, w), G.gemv_fwd(x, w, BLOCK_M=0)
        res[f"batched-{M}-{dtype}"] = 0.0 if torch.equal(batched, turn) and _worst(batched, x, w, _bound(dtype)) <= 1 \
            else 9.0
    x, q, ws = _fp8_inputs(3, 72, 256, True, seed=9)
    res["batched-fp8"] = 0.0 if torch.equal(G.gemv_fwd(x, q, w_scale=ws), G.gemv_fwd(x, q, w_scale=ws, BLOCK_M=0)) \
        else 9.0
    from k3export.fp8 import _fp8_gemv, fp8_linear_wo_ref
    for per_channel in (True, False):                  # E4M3 weights, weight-only: vs fp8_linear_wo_ref in fp64
        x, q, ws = _fp8_inputs(1, 300, 1792, per_channel, seed=7)
        y = _fp8_gemv(x, q, ws)
        r = fp8_linear_wo_ref(x.double(), q, ws.double())
        err = ((y.double() - r).abs() / (BF16_ULP * r.abs() + 1e-6 * r.abs().max())).max().item()
        res[f"fp8-{'channel' if per_channel else 'tensor'}"] = err
    x, q, ws = _fp8_inputs(2, 64, 256, True, seed=8)
    res["fp8-two-rows-declined"] = 0.0 if _fp8_gemv(x, q, ws) is None else 9.0
    from k3export.plugins.gemv.op import gemv_glu_ref
    glu_cases = ((torch.float32, 64, 40, 256), (torch.bfloat16, 32, 21, 200), (torch.bfloat16, 0, 48, 64))
    for dtype, n_plain, I, K in glu_cases:
        g = torch.Generator().manual_seed(n_plain + I)
        x = torch.randn(1, K, generator=g).to(dtype)
        w = (torch.randn(n_plain + 2 * I, K, generator=g) * K ** -0.5).to(dtype)
        z, h = G.gemv_glu_fwd(x, w, n_plain, 1.5, 2.0)
        rz, rh = gemv_glu_ref(x.double(), w.double(), n_plain, 1.5, 2.0)
        rel = 1e-6 if dtype == torch.float32 else BF16_ULP
        for name, out, ref in (("z", z, rz), ("h", h, rh)):
            if out.numel():
                res[f"glu-{name}-{n_plain}-{I}-{dtype}"] = (
                    (out.double() - ref).abs() / (rel * ref.abs() + 1e-6 * ref.abs().max())).max().item()
    for dtype, M, KA, KB, N in ((torch.bfloat16, 1, 200, 56, 300), (torch.float32, 2, 64, 48, 64),
                                (torch.bfloat16, 1, 96, 0, 40)):
        a, b, w, nw = _norm_inputs(M, KA, KB, N, dtype, seed=KA + KB)
        y = G.gemv_norm_fwd(a, b, w, nw, 1e-5)
        assert y.shape == (M, N) and y.dtype == dtype
        res[f"norm-{M}x{KA}+{KB}-{dtype}"] = _norm_worst(y, a, b, w, nw, 1e-5, BF16_ULP if dtype == torch.bfloat16
                                                          else 1e-6)
    for N, KA, KB, fp8, pc in ((40, 100, 60, False, False), (72, 128, 200, True, True), (33, 64, 48, True, False)):
        a, b, wa, sa, wb, sb = _cols_inputs(N, KA, KB, fp8, pc, seed=N + KA)
        y = G.gemv_cols_fwd(a, b, wa, sa, wb, sb)
        res[f"cols-{N}x{KA}+{KB}-{'fp8' if fp8 else 'bf16'}-{'pc' if pc else 'pt'}"] = _cols_worst(y, a, b, wa, sa, wb,
                                                                                                  sb, BF16_ULP)
    return res


def _cols_inputs(N, KA, KB, fp8, per_channel, seed, device="cpu"):
    """One bf16 row each of a `[1, KA]` and b `[1, KB]`, weights `[N, KA]` / `[N, KB]`: bf16 without scales, or E4M3
    with fp32 scales per row (per_channel) or per tensor; a few E4M3 zeros, negatives and subnormals in row 0."""
    from k3export.fp8 import quantize
    g = torch.Generator(device=device).manual_seed(seed)
    a, b = (torch.randn(1, k, generator=g, device=device).to(torch.bfloat16) for k in (KA, KB))
    out = [a, b]
    for K in (KA, KB):
        w = torch.randn(N, K, generator=g, device=device) * K ** -0.5
        if not fp8:
            out += [w.to(torch.bfloat16), None]
            continue
        s = (w.abs().amax(1) / 448) if per_channel else w.abs().max() / 448
        q = quantize(w, s[:, None] if per_channel else s)
        q.view(torch.uint8)[0, :8] = torch.tensor([0, 1, 7, 128, 129, 0x40, 0xC0, 0x08], dtype=torch.uint8)
        out += [q, s.float()]
    return out


def _cols_worst(y, a, b, wa, sa, wb, sb, rel) -> float:
    """max |y - ref| / bound over outputs, ref = `fp8_linear_cols_ref` in fp64, bound = rel |ref| (the output
    rounding) + 1e-6 of the largest |ref| (the fp32 sums)."""
    from k3export.fp8 import fp8_linear_cols_ref
    ref = fp8_linear_cols_ref(a.double(), b.double(), wa, sa if sa is not None else torch.ones((), dtype=torch.float64),
                              wb, sb if sb is not None else torch.ones((), dtype=torch.float64))
    return ((y.double() - ref).abs() / (rel * ref.abs() + 1e-6 * ref.abs().max())).max().item()


def _norm_inputs(M, KA, KB, N, dtype, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    a = (torch.randn(M, KA, generator=g, device=device) * 3).to(dtype)
    b = torch.randn(M, KB, generator=g, device=device).to(dtype)
    w = (torch.randn(N, KA + KB, generator=g, device=device) * (KA + KB) ** -0.5).to(dtype)
    nw = (1 + 0.2 * torch.randn(KA, generator=g, device=device)).to(dtype)
    return a, b, w, nw


def _norm_worst(y, a, b, w, nw, eps, rel) -> float:
    """max over outputs of |y - ref| / bound. ref: `gemv_norm_ref`'s normalised input (rounded to a's dtype as
    `RMSNorm` rounds it) times w in fp64. bound: rel |ref| (the output rounding) + 2 rel sum_k |w_nk x_k| (each input
    element may round one ulp apart twice: another rsqrt / sum order, and the interpreter truncates) + 1e-6 of the
    largest |ref| (the fp32 sum)."""
    af = a.float()
    x = torch.cat([nw * (af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + eps)).to(a.dtype), b], -1).double()
    ref = x @ w.double().t()
    bound = rel * ref.abs() + 2 * rel * (x.abs() @ w.double().abs().t()) + 1e-6 * ref.abs().max()
    return ((y.double() - ref).abs() / bound).max().item()


def _fp8_inputs(M, N, K, per_channel, seed):
    from k3export.fp8 import quantize
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    ws = (w.abs().amax(1) / 448) if per_channel else w.abs().max() / 448
    return x, quantize(w, ws[:, None] if per_channel else ws), ws.float()


def _worst(y, x, w, rel) -> float:
    r = _ref(x, w)
    return ((y.double() - r).abs() / (rel * r.abs() + 1e-6 * r.abs().max())).max().item()


def test_gemv_interpreter_vs_fp64(interp):
    """Each output within its bound of the fp64 product (bf16: one ulp, the interpreter truncates; fp16: the
    rounding; fp32: the accumulation), E4M3 weights with per-channel and per-tensor scales against the weight-only
    FP8 reference in fp64 (`fp8_linear_wo_ref`; the kernel scales after the sum, the reference before: the same
    value up to fp32 rounding), the FP8 one-row path declines two rows, and the SiTU-GLU GEMV's plain rows and
    activations (fp32, bf16; with and without plain rows; an odd pair count) against `gemv_glu_ref` in fp64:
    every ratio error / bound <= 1. 2-4 rows loading their x in one batch (the default there) equal the rows
    taken in turn bit for bit (bf16, fp32, fp16, E4M3 with scales)."""
    assert len(interp) == len(CASES) + 5 + 4 + 5 + 3 + 3
    bad = {k: v for k, v in interp.items() if not v <= 1.0}
    assert not bad, bad


def test_gemv_tile_rule():
    assert G.gemv_tile(2048, 2048) == (8, 2048, 8)
    assert G.gemv_tile(2048, 1792) == (8, 2048, 8)
    assert G.gemv_tile(3072, 768) == (8, 1024, 4)
    assert G.gemv_tile(2048, 8192) == (2, 8192, 8)
    assert G.gemv_tile(7168, 16384) == (1, 16384, 8)
    with pytest.raises(ValueError, match="register tile"):
        G.gemv_tile(7168, 18432)
    x, w = torch.zeros(1, 18432), torch.zeros(4, 18432)
    assert not G.supported(x, w) and not G.supported(torch.zeros(1, 64), torch.zeros(4, 64).t().contiguous().t())


# ---------------------------------------------------------------------------------------------- sm_90 PTX
def _ptx(w="*bf16", **cx):
    from k3export.plugins.aot import compile_ptx
    sig = dict(x="*bf16", w=w, y="*bf16", M="i32", N="i32", K="i32", stride_xm="i32", stride_ym="i32",
               BLOCK_N="constexpr", BLOCK_K="constexpr", PDL="constexpr", PREFETCH="constexpr", EARLY="constexpr",
               w_scale="*fp32" if cx.get("SCALE") else "constexpr", SCALE="constexpr", BLOCK_M="constexpr")
    base = dict(BLOCK_N=8, BLOCK_K=2048, PREFETCH=True, EARLY=False, SCALE=0, BLOCK_M=0)
    if not cx.get("SCALE"):
        base["w_scale"] = None
    return compile_ptx(G.gemv_fwd_kernel, sig, {**base, **cx}, 8).ptx


def _order(ptx: str, stores: bool = False) -> list[str]:
    """griddepcontrol and global loads (and stores), in program order."""
    out = []
    pat = r"(griddepcontrol\.\w+|ld\.global[.\w]*" + (r"|st\.global[.\w]*)" if stores else ")")
    for line in ptx.split(".section")[0].splitlines():
        t = line.split("//")[0].strip()
        m = re.search(pat, t)
        if m:
            g = m.group(1)
            out.append("wait" if "wait" in g else "signal" if "launch" in g else "store" if g.startswith("st") else
                       "load")
    return out


def test_ptx_batched_rows_load_every_x_row_before_the_first_store():
    """BLOCK_M = 4 (sm_90, PDL): the weight tile before the wait as with one row, then every x row's loads, then
    the stores (one dependent round trip for the rows instead of one per row)."""
    order = _order(_ptx(PDL=True, BLOCK_M=4), stores=True)
    wait = order.index("wait")
    assert wait > 0 and order[:wait] == ["load"] * wait
    after = order[wait + 1:]
    first_store = after.index("store")
    assert after[:first_store].count("load") >= 4 and "load" not in after[first_store:]
    assert after[first_store:].count("store") >= 4


def test_ptx_weight_loads_before_the_wait_x_after():
    plain = _order(_ptx(PDL=False))
    assert "wait" not in plain and "signal" not in plain
    on = _order(_ptx(PDL=True))
    wait = on.index("wait")
    assert on[wait + 1] == "signal" and on.count("wait") == 1
    n_w = plain.count("load") - on[wait:].count("load")             # loads hoisted before the wait
    assert n_w > 0 and on[:wait] == ["load"] * n_w                  # the weight tile: all before the wait
    assert on[wait:].count("load") > 0                              # x: after it
    early = _order(_ptx(PDL=True, EARLY=True))
    assert early[0] == "signal" and early.count("wait") == 1        # signalled before anything else
    late = _order(_ptx(PDL=True, PREFETCH=False))
    assert late[:2] == ["wait", "signal"]                           # PREFETCH off: every load after the wait
    for scale in (1, 2):                                            # E4M3 weights and their scales: before it too
        fp8 = _order(_ptx(w="*fp8e4nv", PDL=True, SCALE=scale))
        wait = fp8.index("wait")
        assert fp8[:wait] == ["load"] * wait and wait > 0 and "load" in fp8[wait:]


def test_ptx_cols_weight_loads_before_the_wait():
    """`gemv_cols_fwd_kernel` (sm_90, PDL, EARLY, E4M3 weights with per-row scales, k3-small's MoE output pair): the
    signal first, then both weight tiles' and scales' loads, then the wait, then the a / b loads."""
    from k3export.plugins.aot import compile_ptx
    sig = dict(a="*bf16", b="*bf16", wa="*fp8e4nv", wb="*fp8e4nv", sa="*fp32", sb="*fp32", y="*bf16", N="i32",
               KA="i32", KB="i32", BLOCK_N="constexpr", BLOCK_KA="constexpr", BLOCK_KB="constexpr", SA="constexpr",
               SB="constexpr", PDL="constexpr", EARLY="constexpr")
    bn, bka, bkb, nw = G.cols_tile(2048, 1024, 1536)
    order = _order(compile_ptx(G.gemv_cols_fwd_kernel, sig, dict(BLOCK_N=bn, BLOCK_KA=bka, BLOCK_KB=bkb, SA=2, SB=2,
                                                                  PDL=True, EARLY=True), nw).ptx)
    wait = order.index("wait")
    assert order[0] == "signal" and order.count("wait") == 1 and order[1:wait] == ["load"] * (wait - 1)
    assert wait > 4 and order[wait + 1:].count("load") >= 2


# ---------------------------------------------------------------------------------------------- op and swap
def test_op_reference_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from k3export.plugins.gemv.op import gemv
    x, w = _inputs(1, 40, 64, torch.bfloat16, seed=5)
    y = gemv(x.view(1, 1, 64), w)
    assert y.shape == (1, 1, 40) and y.dtype == torch.bfloat16
    assert torch.equal(y.view(1, 40), _ref(x, w).float().to(torch.bfloat16))
    with FakeTensorMode():
        fy = torch.ops.k3.gemv(torch.empty(2, 3, 64, dtype=torch.bfloat16), torch.empty(40, 64, dtype=torch.bfloat16))
    assert fy.shape == (2, 3, 40) and fy.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def tiny():
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    return random_model(K3Config.from_name("k3-tiny"), seed=0, dtype=torch.float32)


def test_gemv_linears_swaps_classes_only(tiny):
    from k3export.model import packing
    model = tiny
    linears = sum(type(m) is nn.Linear and m.bias is None for m in model.modules())
    try:
        packing.pack_projections(model)
        keys = {k: v.data_ptr() for k, v in model.state_dict().items()}
        n = packing.gemv_linears(model)
        in_packs = sum(type(m) is packing.GemvLinear for m in packing._linears(model)) - sum(
            type(m) is packing.GemvLinear for m in model.modules())
        assert in_packs > 0                                       # the packed GEMMs were swapped too
        assert sum(type(m) is packing.GemvLinear for m in model.modules()) == linears
        assert n == linears + in_packs
        assert {k: v.data_ptr() for k, v in model.state_dict().items()} == keys
        x = torch.randn(1, model.config.hidden_size)
        lin = model.lm_head
        assert type(lin) is packing.GemvLinear and torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
        with packing.unpacked(model):
            assert not any(type(m) is packing.GemvLinear for m in model.modules())
        assert sum(type(m) is packing.GemvLinear for m in model.modules()) == linears
        assert packing.gemv_linears(model, on=False) == 0
        packing.gemv_linears(model)
    finally:
        packing.unpack_projections(model)
    assert not any(type(m) is packing.GemvLinear for m in packing._linears(model))


def test_gemv_linears_rows(tiny):
    """`gemv_linears(rows=)` sets how many rows a GemvLinear sends to `k3::gemv` (1 by default, the class's), kept
    per module and dropped when the swap is undone; the batched-rows rule of the kernel launcher."""
    from k3export.model import packing
    assert [G.batched_rows(m) for m in (1, 2, 3, 4, 5, 16)] == [0, 2, 4, 4, 0, 0]
    try:
        packing.gemv_linears(tiny, rows=4)
        assert {m.gemv_rows for m in packing._linears(tiny) if type(m) is packing.GemvLinear} == {4}
        packing.gemv_linears(tiny)
        assert all("gemv_rows" not in m.__dict__ and m.gemv_rows == 1
                   for m in packing._linears(tiny) if type(m) is packing.GemvLinear)
        packing.gemv_linears(tiny, rows=2)
        packing.gemv_linears(tiny, on=False)
        assert not any("gemv_rows" in m.__dict__ for m in packing._linears(tiny))
        with pytest.raises(ValueError, match="rows must be >= 1"):
            packing.gemv_linears(tiny, rows=0)
    finally:
        packing.unpack_projections(tiny)


def test_kda_decode_inplace_still_folds_f_b_proj_under_gemv(tiny):
    """KDA's in-place decode folds f_b_proj into its kernel for a plain Linear; the GemvLinear swap (the same
    F.linear) must not turn the fold off (that would add one GEMV launch per KDA layer): f_b_proj's forward is
    never called, and the output equals the unswapped model's."""
    from k3export.model import packing
    cfg = tiny.config
    kda = tiny.model.layers[cfg.kda_layers[0]].self_attn
    x = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    st = tiny.new_state(1, 8)
    st.kda_conv.normal_(generator=torch.Generator().manual_seed(1))
    st.kda_state.normal_(std=0.1, generator=torch.Generator().manual_seed(2))
    conv, state = st.kda_conv[0].clone(), st.kda_state[0].clone()
    ref = kda.decode_(x, conv, state)
    packing.gemv_linears(tiny)
    try:
        assert type(kda.f_b_proj) is packing.GemvLinear

        def refuse(*a):
            raise AssertionError("f_b_proj ran outside the decode kernel")
        kda.f_b_proj.forward = refuse
        conv2, state2 = st.kda_conv[0].clone(), st.kda_state[0].clone()
        out = kda.decode_(x, conv2, state2)
    finally:
        del kda.f_b_proj.forward
        packing.gemv_linears(tiny, on=False)
    assert torch.equal(out, ref) and torch.equal(state2, state) and torch.equal(conv2, conv)


def _prefill_then_decode(model, ids, lengths, max_len):
    """Prefill logits of ids `[B, T]` (right padded to `lengths`) from an empty state, then the logits of one decode
    step fed each sequence's last id."""
    st = model.new_state(ids.shape[0], max_len)
    logits, conv, rec, rows = model.forward_prefill(ids, lengths, st.kda_conv, st.kda_state, st.mla_cache,
                                                    torch.zeros(ids.shape[0], dtype=torch.long))
    cache = st.mla_cache.clone()
    cache[:, :, :ids.shape[1]] = rows.to(cache.dtype)
    return logits, model.forward_decode(ids[:, -1], conv, rec, cache, lengths)[0]


def test_glu_packing_same_model_and_swaps_back(tiny):
    """`pack_projections(glu=True)`: the MoE's down | shared gate | shared up and the dense MLP's gate | up as one
    interleaved weight each (`PackedGlu`), the members' weights views of it (gate / up every other row); on CPU the
    swapped MoE's (z, h) and dense MLP's h equal those of the plain packing (fp32: the same dot products with the
    rows in another order, which the CPU GEMM may block differently: 1e-6); the whole model's prefill and decode
    logits stay within 1e-4 of the plain packing's (measured 3.2e-5 / 4.5e-6: the 9 random layers amplify the
    1e-7-level differences, as they do the plain packing's own difference from the model as written, 4.3e-5 /
    2.4e-5 on the same inputs); parameter values are unchanged, and `unpack_projections` removes the swaps."""
    from k3export.model import packing
    from k3export.model.layers import SituMLP
    from k3export.model.moe import LatentMoE
    model = tiny
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([7, 5])

    def run():
        return _prefill_then_decode(model, ids, lengths, 16)
    as_written = run()
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    dense = [m for m in model.modules() if isinstance(m, SituMLP) and not any(m is x.shared_experts for x in moes)]
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    try:
        packing.pack_projections(model)
        want = [moes[0].project_hidden(x), dense[0].hidden(x)]
        packed = run()
        n = packing.pack_projections(model, glu=True)
        glus = [m.__dict__.get(k) for m in model.modules() for k in ("project_hidden", "hidden")
                if isinstance(m.__dict__.get(k), packing.PackedGlu)]
        assert len(glus) == len(moes) + len(dense) > 0 and n > len(glus)
        moe = moes[0]
        glu = moe.__dict__["project_hidden"]
        w = glu.linear.weight
        L = moe.routed_expert_down_proj.out_features
        assert glu.n_plain == L and moe.shared_experts.gate_proj.weight.data_ptr() == w[L].data_ptr()
        assert moe.shared_experts.up_proj.weight.data_ptr() == w[L + 1].data_ptr()
        assert moe.shared_experts.gate_proj.weight.stride(0) == 2 * w.shape[1]
        got = [*moes[0].project_hidden(x), dense[0].hidden(x)]
        for a, b in zip([*want[0], want[1]], got):
            assert ((a - b).abs().max() / a.abs().max()).item() <= 1e-6
        for a, b in zip(packed, run()):
            assert ((a - b).abs().max() / a.abs().max()).item() <= 1e-4
        for k, v in model.state_dict().items():
            assert torch.equal(v, ref_state[k]), k
    finally:
        packing.unpack_projections(model)
    assert not any(isinstance(m.__dict__.get(k), packing.PackedGlu) for m in model.modules()
                   for k in ("project_hidden", "hidden"))
    for a, b in zip(as_written, run()):                           # unswapped: the model as written (gate / up now
        assert ((a - b).abs().max() / a.abs().max()).item() <= 1e-6   # strided views; equal here on this CPU)


def test_gemv_norm_op_is_the_rmsnorm_module_then_the_gemv():
    """`k3::gemv_norm`'s CPU path: `RMSNorm` (the model's module, with its weight and eps) of a, b after it, then
    `gemv_ref`, bit for bit; the fake gives the output's shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from k3export.model.layers import RMSNorm
    from k3export.plugins.gemv.op import gemv_norm, gemv_ref
    for dtype in (torch.bfloat16, torch.float32):
        a, b, w, nw = _norm_inputs(1, 48, 20, 30, dtype, seed=9)
        norm = RMSNorm(48, 1e-5).to(dtype)
        norm.weight.data.copy_(nw)
        with torch.no_grad():
            want = gemv_ref(torch.cat([norm(a), b], -1), w)
        assert torch.equal(gemv_norm(a, b, w, nw, 1e-5), want)
    with FakeTensorMode():
        fy = torch.ops.k3.gemv_norm(torch.empty(1, 1, 48), torch.empty(1, 1, 20), torch.empty(30, 68), torch.empty(48),
                                    1e-5)
    assert fy.shape == (1, 1, 30)


def test_fold_norm_packing_same_values_and_swaps_back(tiny):
    """`pack_projections(fold_norm=True)`: each LatentMoE's `norm_output` becomes a `NormCols` over the packed output
    GEMM and its latent RMSNorm; on CPU (no one-row GEMV there) it computes exactly what the plain packing does:
    the whole model's prefill and decode logits are equal bit for bit; `unpack_projections` removes it."""
    from k3export.model import packing
    from k3export.model.moe import LatentMoE
    model = tiny
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([5, 3])

    def run():
        return _prefill_then_decode(model, ids, lengths, 8)
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    try:
        packing.pack_projections(model)
        plain = run()
        packing.pack_projections(model, fold_norm=True)
        swaps = [m.__dict__.get("norm_output") for m in moes]
        assert moes and all(isinstance(x, packing.NormCols) for x in swaps)
        assert swaps[0].norm is moes[0].routed_expert_norm and swaps[0].packed is moes[0].__dict__["output"]
        for a, b in zip(plain, run()):
            assert torch.equal(a, b)
    finally:
        packing.unpack_projections(model)
    assert not any("norm_output" in m.__dict__ for m in moes)


def test_compile_backend_gemv_only_on_cuda(tiny):
    from k3export.model import packing
    from k3export.runtime import CompileBackend
    b = CompileBackend(tiny, gemv=True)
    try:
        assert b.gemv == 0 and not any(type(m) is packing.GemvLinear for m in packing._linears(tiny))
    finally:
        packing.unpack_projections(tiny)


# ---------------------------------------------------------------------------------------------- GPU
SHAPES = [("kda_in", 8336, 2048), ("kda_o", 2048, 2048), ("mla_q_b", 3072, 768), ("moe_out", 2048, 1792),
          ("dense_out", 2048, 8192), ("lm_head", 32768, 2048), ("k3_q_a", 1536 + 576 + 12288, 7168),
          ("k3_o", 7168, 12288)]


@pytest.mark.cuda
@pytest.mark.parametrize("name,N,K", SHAPES)
def test_gemv_cuda_vs_fp64(name, N, K):
    """bf16 at k3-small and K3 decode shapes: each output within half a bf16 ulp of the fp64 product (the kernel
    rounds to nearest on the GPU) plus the fp32 accumulation."""
    x, w = _inputs(1, N, K, torch.bfloat16, seed=N + K, device="cuda")
    y = G.gemv_fwd(x, w)
    err = _check(y, x, w, 2.0 ** -8 + 1e-5)
    cublas = _ref(x, w).new_tensor(0) + (torch.nn.functional.linear(x, w).double() - _ref(x, w)).abs().max() / _ref(
        x, w).abs().max()
    print(f"{name} [{N}, {K}]: rel err {err:.2e} (cuBLAS {cublas.item():.2e})")


@pytest.mark.cuda
@pytest.mark.parametrize("N,K", [(8336, 2048), (2048, 1792), (3072, 768), (14400, 7168)])
def test_fp8_gemv_cuda_vs_weight_only_reference(N, K, monkeypatch):
    """E4M3 weights (per-channel scales) through `k3::fp8_linear` with K3_FP8_GEMV=1 (the one-row GEMV) at
    k3-small and K3 shapes, with PDL: within one bf16 ulp of the fp64 weight-only reference (+1e-5 of the largest,
    the fp32 sums), and within one ulp of the split-K weight-only kernel it replaces."""
    from k3export.fp8 import fp8_linear, fp8_linear_wo_ref, quantize
    from k3export.fp8_kernels import fp8_linear_wo_fwd
    from k3export.plugins import launch as L
    g = torch.Generator(device="cuda").manual_seed(N + K)
    x = torch.randn(1, K, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(N, K, generator=g, device="cuda") * K ** -0.5
    ws = (w.abs().amax(1) / 448).float()
    q = quantize(w, ws[:, None])
    monkeypatch.setenv("K3_FP8_GEMV", "1")
    with L.pdl(torch.cuda.get_device_capability()[0] >= 9):
        y = fp8_linear(x, torch.ones((), device="cuda"), q, ws)
    r = fp8_linear_wo_ref(x.double(), q, ws.double())
    old = fp8_linear_wo_fwd(x, q, ws)
    for other in (r, old.double()):
        err = (y.double() - other).abs()
        bound = BF16_ULP * torch.maximum(y.double().abs(), other.abs()) + 1e-5 * other.abs().max()
        assert (err <= bound).all(), (err / bound).max().item()


@pytest.mark.cuda
@pytest.mark.parametrize("n_plain,I,K", [(1024, 768, 2048), (0, 4096, 2048), (3584, 3072, 7168)])
def test_gemv_glu_cuda_vs_reference(n_plain, I, K):
    """k3-small MoE input (down 1024 | 768 shared gate/up pairs), its dense MLP (4096 pairs), K3's MoE input; bf16,
    with PDL on sm_90: the plain rows within half a bf16 ulp of the fp64 product (+1e-5 of the largest, the fp32
    sum), the activations within half an ulp of `gemv_glu_ref` in fp64 on the same bf16 inputs plus 1e-5 of the
    largest (the fp32 sums and the kernel's tanh, ~3e-7 relative)."""
    from k3export.plugins import launch as L
    from k3export.plugins.gemv.op import gemv_glu_ref
    g = torch.Generator(device="cuda").manual_seed(n_plain + I)
    x = torch.randn(1, K, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n_plain + 2 * I, K, generator=g, device="cuda") * K ** -0.5).to(torch.bfloat16)
    assert G.glu_supported(x, w, n_plain)
    with L.pdl(torch.cuda.get_device_capability()[0] >= 9):
        z, h = torch.ops.k3.gemv_glu(x, w, n_plain, 1.0, 1.0)
    rz, rh = gemv_glu_ref(x.double(), w.double(), n_plain, 1.0, 1.0)
    for out, ref in ((z, rz), (h, rh)):
        if out.numel():
            err = (out.double() - ref).abs()
            assert (err <= 2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max()).all(), (err / ref.abs().max()).max().item()


@pytest.mark.cuda
@pytest.mark.parametrize("variant,method,swap", [("compile-glu", "project_hidden", "PackedGlu"),
                                                 ("compile-fast", "norm_output", "NormCols")])
def test_k3_tiny_fp32_compile_swaps_at_b1_generate_eager_tokens(variant, method, swap):
    """k3-tiny fp32, one prompt at B = 1 through `compile-glu` (SiTU-GLU in the one-row GEMV of the MoE and MLP
    input projections, PDL on sm_90) and `compile-fast` (that, the latent norm in the MoE output GEMV and the MoE
    kernels on PDL): the greedy tokens of the model as written, run eagerly."""
    from k3export.bench.model import COMPILE_VARIANTS
    from k3export.config import K3Config
    from k3export.generate import generate
    from k3export.model import packing
    from k3export.model.weights import random_model
    from k3export.runtime import CompileBackend, Engine, Generator
    model = random_model(K3Config.from_name("k3-tiny"), seed=0, device="cuda")
    prompt = [[5, 17, 3, 99, 42, 7, 1, 64]]
    ref = generate(model, prompt, 8)
    backend = CompileBackend(model, **COMPILE_VARIANTS[variant])
    assert any(isinstance(m.__dict__.get(method), getattr(packing, swap)) for m in model.modules())
    out = Generator(Engine(backend, max_batch=1, max_len=32)).generate(prompt, 8)
    packing.unpack_projections(model)
    assert out == ref


@pytest.mark.cuda
@pytest.mark.parametrize("KA,KB,N", [(1024, 1536, 2048), (3584, 6144, 7168), (1024, 0, 2048)])
def test_gemv_norm_cuda_vs_reference(KA, KB, N):
    """k3-small's and K3's MoE output GEMM over [RMSNorm(u) | h] (and one without h), bf16, with PDL on sm_90:
    every output within `_norm_worst`'s bound of the fp64 product on the RMSNorm-rounded input (GPU: half-ulp
    roundings, so the bound holds with the half-ulp `rel`)."""
    from k3export.plugins import launch as L
    a, b, w, nw = _norm_inputs(1, KA, KB, N, torch.bfloat16, seed=KA + KB, device="cuda")
    assert G.norm_supported(a, b, w, nw)
    with L.pdl(torch.cuda.get_device_capability()[0] >= 9):
        y = torch.ops.k3.gemv_norm(a, b, w, nw, 1e-5)
    assert _norm_worst(y, a, b, w, nw, 1e-5, 2.0 ** -8) <= 1.0


@pytest.mark.cuda
def test_gemv_chain_in_a_cuda_graph_with_pdl_same_bits():
    """24 chained GEMVs (each reads the previous output), captured with PDL (early and late signal) and without:
    every output zeroed before each replay, 3 replays, all equal bit for bit to the uncaptured plain launches."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    from k3export.plugins import launch as L
    shapes = [(2048 + 64 * i, 2048) if i % 2 == 0 else (2048, 2048 + 64 * (i - 1)) for i in range(24)]
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16) for n, k in shapes]
    x0 = torch.randn(1, 2048, generator=g, device="cuda").to(torch.bfloat16)

    def chain(ys):
        x = x0
        for w, y in zip(ws, ys):
            G._cuda(x[:, :w.shape[1]], w) if y is None else y.copy_(G._cuda(x[:, :w.shape[1]], w))
            x = y
        return ys

    ref = chain([torch.empty(1, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws])
    for on, early in ((False, True), (True, True), (True, False)):
        ys = [torch.empty(1, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]
        old = G.EARLY
        G.EARLY = early
        try:
            with L.pdl(on):
                chain(ys)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    chain(ys)
        finally:
            G.EARLY = old
        for _ in range(3):
            for y in ys:
                y.zero_()
            graph.replay()
            torch.cuda.synchronize()
            for i, (a, b) in enumerate(zip(ys, ref)):
                assert torch.equal(a, b), (on, early, i)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [2, 3, 4])
@pytest.mark.parametrize("name,N,K", [SHAPES[0], SHAPES[4], SHAPES[5]])
def test_gemv_batched_rows_cuda(name, N, K, M):
    """2-4 rows with their x loaded in one batch (`batched_rows`): each output within half a bf16 ulp of the fp64
    product plus the fp32 accumulation, and bit-identical to the same rows taken in turn (BLOCK_M 0)."""
    x, w = _inputs(M, N, K, torch.bfloat16, seed=N + K + M, device="cuda")
    y = G.gemv_fwd(x, w)
    err = _check(y, x, w, 2.0 ** -8 + 1e-5)
    assert torch.equal(y, G.gemv_fwd(x, w, BLOCK_M=0))
    print(f"{name} [{N}, {K}] x {M} rows: rel err {err:.2e}")


@pytest.mark.cuda
@pytest.mark.parametrize("B", [2, 4])
def test_k3_tiny_fp32_compile_gemv4_generates_eager_tokens(B):
    """B = 2 prompts decoding together through the default `CompileBackend` (`gemv_rows` 2), B = 4 through
    `gemv_rows=4` (bench `compile-gemv4`), k3-tiny fp32 on the GPU: the greedy tokens of the eager model. A
    GemvLinear sends up to its rows to `k3::gemv`, one more to `F.linear`."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from k3export.config import K3Config
    from k3export.generate import generate
    from k3export.model import packing
    from k3export.model.weights import random_model
    from k3export.runtime import CompileBackend, Engine, Generator

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))
    model = random_model(K3Config.from_name("k3-tiny"), seed=0, device="cuda")
    prompts = [[5, 17, 3, 99, 42, 7, 1, 64], [9, 2, 33], [70, 71, 72, 73, 74], [1]][:B]
    ref = generate(model, prompts, 8)
    backend = CompileBackend(model) if B == 2 else CompileBackend(model, gemv_rows=4)
    try:
        head = model.lm_head
        assert type(head) is packing.GemvLinear and head.gemv_rows == B
        for rows, op in ((1, "k3.gemv"), (B, "k3.gemv"), (B + 1, "aten.mm")):
            with torch.no_grad(), Ops() as ops:
                head(torch.randn(rows, model.config.hidden_size, device="cuda"))
            assert op in ops.seen, (rows, ops.seen)
        out = Generator(Engine(backend, max_batch=B, max_len=32)).generate(prompts, 8)
    finally:
        packing.unpack_projections(model)
    assert out == ref


@pytest.mark.cuda
def test_k3_tiny_fp32_compile_at_b1_generates_eager_tokens():
    """k3-tiny fp32 on the GPU, one prompt at B = 1 through the `compile` backend (its one-row linears on
    `k3::gemv`, PDL on sm_90): the greedy tokens of the model as written, run eagerly (fp32: the GEMV's other
    summation order moves the logits by ~1e-6, far from any argmax margin of a tiny model)."""
    from k3export.config import K3Config
    from k3export.generate import generate
    from k3export.model import packing
    from k3export.model.weights import random_model
    from k3export.runtime import CompileBackend, Engine, Generator
    model = random_model(K3Config.from_name("k3-tiny"), seed=0, device="cuda")
    prompt = [[5, 17, 3, 99, 42, 7, 1, 64]]
    ref = generate(model, prompt, 8)
    backend = CompileBackend(model)
    assert backend.gemv > 0
    out = Generator(Engine(backend, max_batch=1, max_len=32)).generate(prompt, 8)
    packing.unpack_projections(model)
    assert out == ref


@pytest.mark.cuda
def test_k3_small_every_gemv_call_of_a_decode_step_vs_cublas():
    """k3-small bf16, prefill then 3 decode steps at B = 1 (eager, the model's packed linears as GemvLinears):
    every `k3::gemv` call against F.linear (cuBLAS) on the same inputs: each output within one bf16 ulp of cuBLAS's
    (both round an fp32 sum; other summation orders may land on the neighbouring value) plus 1e-5 of the largest
    (cancellation near zero). Whole-model logits are not compared: through 12 random bf16 layers rounding-level
    differences grow to O(1) (tests/test_packing.py; measured: one GEMV-ulp difference at step 1 -> 1.0 by step 2)."""
    import torch.nn.functional as F

    from k3export.config import K3Config
    from k3export.model import packing
    from k3export.model.weights import random_model
    from k3export.runtime import EagerBackend, Engine
    model = random_model(K3Config.from_name("k3-small"), seed=0, dtype=torch.bfloat16, device="cuda")
    packing.pack_projections(model)
    packing.fuse_norms(model)
    n = packing.gemv_linears(model)
    worst, calls = [0.0], [0]

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if x.numel() == x.shape[-1]:
            z = torch.ops.k3.gemv(x, self.weight)
            err = (z.float() - y.float()).abs()
            bound = BF16_ULP * torch.maximum(y.float().abs(), z.float().abs()) + 1e-5 * y.float().abs().max()
            worst[0] = max(worst[0], (err / bound).max().item())
            calls[0] += 1
        return y
    prompt = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    old = packing.GemvLinear.forward
    packing.GemvLinear.forward = forward
    try:
        eng = Engine(EagerBackend(model), max_batch=1, max_len=64, cuda_graphs=False)
        logits = eng.prefill([0], [prompt])
        for _ in range(3):
            logits = eng.decode(logits.argmax(-1))
    finally:
        packing.GemvLinear.forward = old
        packing.unpack_projections(model)
    print(f"{calls[0]} GEMV calls ({n} GemvLinears); worst error / bound {worst[0]:.2f}")
    assert calls[0] >= 3 * 52 and worst[0] <= 1.0                # 51 projections + lm_head per step at least


if __name__ == "__main__":
    print(json.dumps(_interpreter_cases()))
