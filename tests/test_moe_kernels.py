"""Triton LatentMoE kernels (`plugins/moe/kernels.py`) against the plain-torch twins (`plugins/moe/naive.py`).

CPU: the kernels run under TRITON_INTERPRET=1 at tiny shapes in fp32 and fp16 (triton 3.9's interpreter computes
bf16 `tl.dot` wrongly), both tile regimes. GPU (`cuda`): K3 shapes (d = 7168, 896 experts, top-16,
3584 -> 3072 -> 3584, bf16) through `torch.ops.k3.moe_routed`, ties, hot experts, experts with no token.

Error = max |kernel - reference| / max |reference| on the same inputs.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

if __name__ == "__main__":  # the interpreter run (see `interp` in conftest.py): the flag must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from k3export.plugins.moe.naive import moe_sorted, route

# Named bounds. fp32 vs fp64: reordered fp32 sums (router over d, experts over L and I).
FP32_BOUND = 1e-5
# fp16 (CPU) vs the fp64 reference: the kernel rounds h (and the matmul inputs are fp16) once: ~2^-11 relative.
FP16_BOUND = 2e-3
# bf16 (GPU) vs moe_sorted on the same bf16 inputs: the reference rounds z W1^T, z W3^T and each expert's output
# to bf16 (the kernel keeps them fp32) and both round h to bf16: a few 2^-9 relative roundings.
BF16_BOUND = 2e-2
# Router weights: fp32 sums in another order over d = 7168 products.
WEIGHT_BOUND = 1e-5
SITU = dict(beta=4.0, linear_beta=25.0)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _rel(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _weights(E, d, L, I, dtype, device="cpu", gen=None):
    g = torch.randn(E, d, device=device, dtype=dtype, generator=gen) * d ** -0.5
    b = torch.randn(E, device=device, generator=gen) * 0.1
    w1 = torch.randn(E, I, L, device=device, dtype=dtype, generator=gen) * L ** -0.5
    w3 = torch.randn(E, I, L, device=device, dtype=dtype, generator=gen) * L ** -0.5
    w2 = torch.randn(E, L, I, device=device, dtype=dtype, generator=gen) * I ** -0.5
    return g, b, w1, w3, w2


def _plan_matches_up_to_order(ids, E, bm) -> bool:
    """align_rows(fused=True) vs the torch plan: the same block table and padding rows, every pair once, each in a
    block of its expert."""
    from k3export.plugins.moe.kernels import align_rows
    (rp, be), (rp_ref, be_ref) = align_rows(ids, E, bm, many=True), align_rows(ids, E, bm, fused=False)
    flat, ok = ids.reshape(-1).long(), rp >= 0
    block = torch.arange(rp.numel(), device=rp.device) // bm
    return (torch.equal(be, be_ref) and torch.equal(ok, rp_ref >= 0)
            and bool((flat[rp[ok].long()] == be[block[ok]].long()).all())
            and torch.equal(rp[ok].sort().values.long(), torch.arange(flat.numel(), device=rp.device)))


def _interp_tiles(t):
    """t with the chunked align's chunks shrunk to 64 pairs: the interpreter's `tl.sort` takes seconds at 1024."""
    return replace(t, chunk_align=64) if t.chunk_align else t


def _interpreter_cases() -> dict:
    """Every CPU case, run in this process under TRITON_INTERPRET=1 -> {case: relative error or flag}."""
    from k3export.plugins.moe.kernels import TILINGS, MoeTiles, align_rows, interleave_gate_up, moe_routed_fwd, route_fwd
    res = {}
    N, d, E, I, L, k = 7, 48, 12, 40, 24, 4          # 28 pairs over 12 experts: some get none
    for name, dt in DTYPES.items():
        torch.manual_seed(0)
        x, z = torch.randn(N, d, dtype=dt), torch.randn(N, L, dtype=dt)
        g, b, w1, w3, w2 = _weights(E, d, L, I, dt)
        args64 = [t.double() for t in (x, z, g, b, w1, w3, w2)]
        cases = [("decode", k, True), ("decode", k, False), ("decode", 1, True)] if name == "fp32" else \
            [("decode", k, True), ("prefill", k, True)]                  # top-1: never renormalised
        for regime, top_k, renorm in cases:
            u = moe_routed_fwd(x, z, g, b, w1, w3, w2, top_k, renorm, 2.5, regime=regime, **SITU)
            assert u.dtype == dt and u.shape == z.shape
            ref = moe_sorted(*args64, top_k, renorm, 2.5, **SITU)
            res[f"moe-{name}-{regime}-k{top_k}-{renorm}"] = _rel(u, ref)
        ids, w, _ = route_fwd(x, g, b, k, True, 1.0)
        rids, rw = route(*args64[:1], args64[2], b, k, True, 1.0)
        res[f"route-ids-{name}"] = float(torch.equal(ids.long(), rids))
        res[f"route-w-{name}"] = (w.double() - rw).abs().max().item()
        for n in (N, 70):                        # lean: router split over d (N <= 64), packed top-k (both N)
            xx = torch.randn(n, d, dtype=dt)
            ids, w, s = route_fwd(xx, g, b, k, True, 1.0, lean=True)
            rids, rw = route(xx.double(), g.double(), b, k, True, 1.0)
            res[f"route-lean-ids-{name}-{n}"] = float(torch.equal(ids.long(), rids))
            res[f"route-lean-w-{name}-{n}"] = (w.double() - rw).abs().max().item()
            s64 = torch.sigmoid(xx.double() @ g.double().T)
            res[f"route-lean-s-{name}-{n}"] = (s.double() - s64).abs().max().item()
        if name == "fp16":                       # wide router tiles (128 x 128, 8 warps) from ROUTE_WIDE_MIN_N tokens
            xx = torch.randn(1030, d, dtype=dt)
            ids, w, s = route_fwd(xx, g, b, k, True, 1.0, lean=True, wide=True)
            rids, rw = route(xx.double(), g.double(), b, k, True, 1.0)
            res["route-wide-ids-fp16"] = float(torch.equal(ids.long(), rids))
            res["route-wide-w-fp16"] = (w.double() - rw).abs().max().item()
        # Negative keys (bias - 3): the packed top-k's float -> ordered-int map must keep their order.
        ids = route_fwd(x, g, b - 3.0, k, True, 1.0, lean=True)[0]
        res[f"route-lean-ids-negative-{name}"] = float(torch.equal(ids.long(), route(*args64[:1], args64[2], b - 3.0, k,
                                                                                     True, 1.0)[0]))
    # Small |z| (z * 1e-3, tanh arguments ~1e-4): the activation's tanh must keep its relative accuracy near 0,
    # where 2 sigmoid(2x) - 1 cancels (measured: 9.6e-4 with it, 1.6e-7 with the series); u ~ |z|^2.
    torch.manual_seed(2)
    x, z = torch.randn(N, d), torch.randn(N, L) * 1e-3
    g, b, w1, w3, w2 = _weights(E, d, L, I, torch.float32)
    u = moe_routed_fwd(x, z, g, b, w1, w3, w2, k, True, 2.5, regime="decode", **SITU)
    res["moe-fp32-small-z"] = _rel(u, moe_sorted(x.double(), z.double(), g.double(), b, w1.double(), w3.double(),
                                                 w2.double(), k, True, 2.5, **SITU))
    # Ties: experts 2j and 2j+1 are copies (gate row, bias, weights), so any tie-break gives the same u; the kernel
    # takes the lower id. One hot expert (huge bias) gets every token: several blocks of one expert.
    torch.manual_seed(1)
    x, z = torch.randn(20, d), torch.randn(20, L)      # the hot expert gets 20 rows: 2 blocks of 16
    g, b, w1, w3, w2 = _weights(E, d, L, I, torch.float32)
    for t in (g, b, w1, w3, w2):
        t[1::2] = t[0::2]
    b[4] = b[5] = 100.0
    ids, _, _ = route_fwd(x, g, b, k, True, 1.0)
    res["ties-lower-id-first"] = float((ids[:, 0] == 4).all().item() and (ids[:, 1] == 5).all().item())
    lean = route_fwd(x, g, b, k, True, 1.0, lean=True)[0]
    res["ties-lower-id-first-lean"] = float(torch.equal(lean, ids))
    for regime in ("decode",):
        u = moe_routed_fwd(x, z, g, b, w1, w3, w2, k, True, 1.0, regime=regime, **SITU)
        res[f"ties-{regime}"] = _rel(u, moe_sorted(x.double(), z.double(), g.double(), b, w1.double(), w3.double(),
                                                   w2.double(), k, True, 1.0, **SITU))
    # Every named tiling (the GPU sweep's candidates, real block sizes) on the same fp16 draw; TMA descriptors
    # included (a weight tile past I reads the next expert's rows, which must never reach h).
    torch.manual_seed(3)
    x, z = torch.randn(N, d, dtype=torch.float16), torch.randn(N, L, dtype=torch.float16)
    w16 = _weights(E, d, L, I, torch.float16)
    ref = moe_sorted(x.double(), z.double(), w16[0].double(), w16[1], *(t.double() for t in w16[2:]), k, True, 1.0,
                     **SITU)
    for regime, tilings in TILINGS.items():
        for name, t in tilings.items():
            t = _interp_tiles(t)
            u = moe_routed_fwd(x, z, *w16, k, True, 1.0, tiles=t, **SITU)
            res[f"tiles-{regime}-{name}"] = _rel(u, ref)
            if t.pairs:                          # the "pairs" path runs only up to t.pairs tokens: those too
                n = t.pairs
                u = moe_routed_fwd(x[:n], z[:n], *w16, k, True, 1.0, tiles=t, **SITU)
                res[f"tiles-{regime}-{name}"] = max(res[f"tiles-{regime}-{name}"], _rel(u, ref[:n]))
    # The pairs GEMVs above take L = 24 in one BLOCK_K step; BK 16 runs their K loops (as K3_MOE_PAIR_BK can).
    t = replace(TILINGS["decode"]["pairs-n8-fc"], pair_gemm=((8, 16, 4), (8, 16, 4)))
    u = moe_routed_fwd(x[:t.pairs], z[:t.pairs], *w16, k, True, 1.0, tiles=t, **SITU)
    res["tiles-pairs-bk16-loop"] = _rel(u, ref[:t.pairs])
    # The same draw with gate/up rows interleaved in one tensor (`interleave_gate_up`): TMA tilings read one
    # [2 BN, BK] tile per step (PAIRED), pointer tilings and the "pairs" GEMVs read the strided views. I = 40 is
    # not a multiple of any BLOCK_N: a paired tile past I reads the next expert's rows, never stored.
    wp = (*w16[:2], *interleave_gate_up(w16[2], w16[3])[1:], w16[4])
    for regime, name in PAIRED_TILINGS:
        t = _interp_tiles(TILINGS[regime][name])
        n = t.pairs or N
        u = moe_routed_fwd(x[:n], z[:n], *wp, k, True, 1.0, tiles=t, **SITU)
        res[f"paired-{regime}-{name}"] = _rel(u, ref[:n])
    # Tail rows (MoeTiles.tail): 140 tokens top-2 over 3 experts, expert 0 hot (every token: 140 rows, past a
    # 128-row BLOCK_M into the tail), the others ~70 rows; every prefill tiling with a tail, and small tail
    # tilings (16 + 16 rows: several blocks per expert, blocks ending inside the tail or before it).
    torch.manual_seed(5)
    xt, zt = torch.randn(140, d, dtype=torch.float16), torch.randn(140, 16, dtype=torch.float16)
    wt = list(_weights(3, d, 16, 32, torch.float16))
    wt[1][0] = 50.0
    ref = moe_sorted(xt.double(), zt.double(), wt[0].double(), wt[1], *(t.double() for t in wt[2:]), 2, True, 1.0,
                     **SITU)
    tail_tilings = {f"prefill-{n}": t for n, t in TILINGS["prefill"].items() if t.tail}
    tail_tilings.update({f"small-{tma or 'ptr'}": MoeTiles(16, (32, 32, 4, 1), (32, 32, 4, 1), 1, tma, True, False, 16)
                         for tma in ("", "w", "aw")})
    wtp = (*wt[:2], *interleave_gate_up(wt[2], wt[3])[1:], wt[4])
    for name, t in tail_tilings.items():
        t = _interp_tiles(t)
        u = moe_routed_fwd(xt, zt, *wt, 2, True, 1.0, tiles=t, **SITU)
        res[f"tail-{name}"] = _rel(u, ref)
        if t.tma:
            u = moe_routed_fwd(xt, zt, *wtp, 2, True, 1.0, tiles=t, **SITU)
            res[f"tail-paired-{name}"] = _rel(u, ref)
    # Rows of 20 fp16 (40 bytes) cannot be TMA rows: the TMA tilings fall back to pointer loads.
    torch.manual_seed(4)
    x20, z20 = torch.randn(N, d, dtype=torch.float16), torch.randn(N, 20, dtype=torch.float16)
    w20 = _weights(E, d, 20, 36, torch.float16)
    u = moe_routed_fwd(x20, z20, *w20, k, True, 1.0, tiles=TILINGS["prefill"]["m128-tma-aw"], **SITU)
    res["tiles-tma-unaligned-rows"] = _rel(u, moe_sorted(x20.double(), z20.double(), w20[0].double(), w20[1],
                                                          *(t.double() for t in w20[2:]), k, True, 1.0, **SITU))
    # The one-program align kernel == the torch align (same row plan), incl. a hot expert with several blocks,
    # top-1 and a pair count that is not a power of two.
    same = []
    for n, kk, ee, bm in [(1, 4, 12, 16), (7, 4, 12, 16), (50, 3, 12, 16), (40, 4, 12, 64), (9, 1, 5, 16)]:
        ids = torch.stack([torch.randperm(ee)[:kk] for _ in range(n)]).int()
        ids[: n // 2, 0] = 2                                            # expert 2 hot
        a, b2 = align_rows(ids, ee, bm, fused=True), align_rows(ids, ee, bm, fused=False)
        same.append(torch.equal(a[0], b2[0]) and torch.equal(a[1], b2[1]))
    res["align-fused-equals-torch"] = float(all(same))
    # Beyond ALIGN_FUSED_MAX pairs the Triton align is count (atomics) / scan / scatter: the rows of an expert come
    # in arrival order, so the plan equals the torch one up to the order inside each expert's rows.
    ok = []
    for n, kk, ee, bm in [(1030, 4, 12, 192), (1100, 4, 12, 128), (2000, 3, 7, 96)]:
        ids = torch.stack([torch.randperm(ee)[:kk] for _ in range(n)]).int()
        ids[: n // 2, 0] = 2
        ok.append(_plan_matches_up_to_order(ids, ee, bm))
    res["align-atomic-valid"] = float(all(ok))
    # The chunked align (3 launches, no atomics) is stable: the torch plan exactly, incl. chunks of 64 pairs
    # split inside an expert's rows, an expert hot in every chunk, one that no pair takes, and < 1 chunk.
    same = []
    for n, kk, ee, bm in [(103, 4, 12, 192), (110, 4, 13, 128), (150, 3, 7, 96), (5, 2, 9, 16)]:
        ids = torch.stack([torch.randperm(ee - 1)[:kk] for _ in range(n)]).int()       # expert ee - 1: no pair
        ids[: n // 2, 0] = 2
        a, b2 = align_rows(ids, ee, bm, fused=False, chunked=64), align_rows(ids, ee, bm, fused=False)
        same.append(torch.equal(a[0], b2[0]) and torch.equal(a[1], b2[1]))
    res["align-chunked-equals-torch"] = float(all(same))
    try:
        moe_routed_fwd(x, z[:, :-1], g, b, w1, w3, w2, k, True, 1.0, **SITU)
        res["bad-shape-named"] = 0.0
    except ValueError as e:
        res["bad-shape-named"] = float("w1" in str(e))
    return res


@pytest.mark.parametrize("case,bound", [("moe-fp32-decode-k4-True", FP32_BOUND), ("moe-fp32-decode-k4-False",
                          FP32_BOUND), ("moe-fp32-decode-k1-True", FP32_BOUND), ("moe-fp16-decode-k4-True",
                          FP16_BOUND), ("moe-fp16-prefill-k4-True", FP16_BOUND), ("ties-decode", FP32_BOUND),
                          ("moe-fp32-small-z", FP32_BOUND), ("route-w-fp32", WEIGHT_BOUND),
                          ("route-w-fp16", WEIGHT_BOUND), ("route-lean-w-fp32-7", WEIGHT_BOUND),
                          ("route-lean-w-fp32-70", WEIGHT_BOUND), ("route-lean-w-fp16-7", WEIGHT_BOUND),
                          ("route-lean-w-fp16-70", WEIGHT_BOUND), ("route-lean-s-fp32-7", WEIGHT_BOUND),
                          ("route-lean-s-fp16-7", WEIGHT_BOUND), ("route-wide-w-fp16", WEIGHT_BOUND)])
def test_interpreted(interp, case, bound):
    assert interp[case] < bound, interp


# Tilings also run on paired gate/up weights on CPU: every prefill TMA tiling (the PAIRED kernel path), a decode
# TMA tiling, the default pairs GEMVs and a pointer tiling (strided views).
PAIRED_TILINGS = [("prefill", "m128-tma-aw"), ("prefill", "m128-tma-w"), ("prefill", "m128t64-aw"),
                  ("prefill", "m64t32-n128-aw8"), ("prefill", "old"), ("decode", "fused-lean-tma"),
                  ("decode", "pairs-n8-fc"), ("decode", "pairs-n8-fc-g1")]


def _tiling_names():
    from k3export.plugins.moe.kernels import TILINGS
    return [f"{regime}-{name}" for regime, t in TILINGS.items() for name in t]


@pytest.mark.parametrize("tiles", _tiling_names() + ["tma-unaligned-rows", "pairs-bk16-loop"])
def test_interpreted_tilings(interp, tiles):
    assert interp[f"tiles-{tiles}"] < FP16_BOUND, interp


def _tail_names():
    from k3export.plugins.moe.kernels import TILINGS
    return [f"prefill-{n}" for n, t in TILINGS["prefill"].items() if t.tail] + ["small-ptr", "small-w", "small-aw"]


@pytest.mark.parametrize("tiles", _tail_names())
def test_interpreted_tail_rows(interp, tiles):
    """Experts with more rows than a block's BLOCK_M (the tail dot used), a hot expert over several blocks."""
    assert interp[f"tail-{tiles}"] < FP16_BOUND, interp
    if f"tail-paired-{tiles}" in interp:
        assert interp[f"tail-paired-{tiles}"] < FP16_BOUND, interp


@pytest.mark.parametrize("tiles", [f"{r}-{n}" for r, n in PAIRED_TILINGS])
def test_interpreted_paired_gate_up(interp, tiles):
    """Gate/up rows interleaved in one tensor (`interleave_gate_up`) give the separate layout's result."""
    assert interp[f"paired-{tiles}"] < FP16_BOUND, interp


def test_paired_gate_up_layout():
    """interleave_gate_up's views equal w1 / w3 and share one contiguous tensor; paired_gate_up recognises exactly
    that layout (not swapped views, copies, other strides or dtypes)."""
    from k3export.plugins.moe.kernels import interleave_gate_up, paired_gate_up
    w1, w3 = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    w13, p1, p3 = interleave_gate_up(w1, w3)
    assert w13.shape == (3, 10, 8) and w13.is_contiguous()
    assert torch.equal(p1, w1) and torch.equal(p3, w3) and torch.equal(w13[:, 1::2], w3)
    assert paired_gate_up(p1, p3).data_ptr() == w13.data_ptr() and torch.equal(paired_gate_up(p1, p3), w13)
    assert paired_gate_up(w1, w3) is None and paired_gate_up(p3, p1) is None
    assert paired_gate_up(p1.contiguous(), p3.contiguous()) is None
    assert paired_gate_up(p1, interleave_gate_up(w1, w3)[2]) is None          # another tensor's odd rows
    assert paired_gate_up(p1.half(), p3.half()) is None


def test_default_tiling_by_regime_layout_and_latent():
    """`tiles_for`: the regime by rows per expert, then the layout (paired gate/up first) and the latent width (the
    "prefill" regime on 128-row TMA blocks from WIDE_L, measured at K3's 3584 vs k3-small's 1024); fp32 always
    the exact small tiles."""
    from k3export.plugins.moe.kernels import (CONFIGS, FP32_TILES, PAIRED_CONFIGS, TILINGS, WIDE_L, pick_regime,
                                              tiles_for)
    wide = torch.empty(1, 3584, dtype=torch.bfloat16, device="meta")
    narrow = torch.empty(1, 1024, dtype=torch.bfloat16, device="meta")
    P = TILINGS["prefill"]
    assert [pick_regime(n * 16, 896) for n in (5, 2048, 4096, 8192, 16384)] == [
        "decode", "grouped", "prefill", "prefill-mid", "prefill-large"]
    assert tiles_for(wide, 2048 * 16, 896) is P["m64t32-aw8"] is CONFIGS["grouped"]
    assert tiles_for(wide, 4096 * 16, 896) is P["m128-tma-aw-y16r-f2"] and 3584 >= WIDE_L > 1024
    assert tiles_for(narrow, 512 * 8, 64) is CONFIGS["prefill"] is P["m64t32-n128-aw8-y16r-f2"]     # 64 rows
    assert tiles_for(wide, 4096 * 16, 896, paired=True) is CONFIGS["prefill"]
    assert tiles_for(wide, 16384 * 16, 896, paired=True) is PAIRED_CONFIGS["prefill-large"]
    assert tiles_for(wide, 16384 * 16, 896) is CONFIGS["prefill-large"]
    assert tiles_for(wide.float(), 4096 * 16, 896) is FP32_TILES


@pytest.mark.parametrize("flag", ["route-ids-fp32", "route-ids-fp16", "ties-lower-id-first", "bad-shape-named",
                                  "align-fused-equals-torch", "align-atomic-valid", "align-chunked-equals-torch",
                                  "ties-lower-id-first-lean",
                                  "route-lean-ids-negative-fp32",
                                  "route-lean-ids-negative-fp16", "route-lean-ids-fp32-7",
                                  "route-lean-ids-fp32-70", "route-lean-ids-fp16-7", "route-lean-ids-fp16-70",
                                  "route-wide-ids-fp16"])
def test_interpreted_flags(interp, flag):
    assert interp[flag] == 1.0, interp


# ---------------------------------------------------------------------------------------------- GPU, K3 shapes
@pytest.fixture(scope="module")
def k3_experts():
    """K3's routed experts at full size in bf16 (59 GB), random, built once for the GPU tests."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = _weights(896, 7168, 3584, 3072, torch.bfloat16, "cuda", gen)
    yield w
    del w
    torch.cuda.empty_cache()


def _routing_is_clear(x, g, b, k):
    """True when the k-th and (k+1)-th selection keys differ by more than fp32 reordering could move them."""
    s = torch.sigmoid(x.float() @ g.float().T) + b
    top = torch.topk(s, k + 1, dim=-1).values
    return bool(((top[:, k - 1] - top[:, k]) > 1e-5).all())


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 5, 64, 300])      # 1..64: decode tiles; 300 (4800 pairs): grouped-GEMM tiles
def test_moe_k3_shapes(k3_experts, N):
    g, b, w1, w3, w2 = k3_experts
    torch.manual_seed(N)
    x = torch.randn(N, 7168, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(N, 3584, device="cuda", dtype=torch.bfloat16)
    if not _routing_is_clear(x, g, b, 16):
        pytest.skip("a near-tie at the top-16 boundary on this draw: selection legitimately ambiguous")
    u = torch.ops.k3.moe_routed(x, z, g, b, w1, w3, w2, 16, True, 1.0, 4.0, 25.0)
    ref = moe_sorted(x, z, g, b, w1, w3, w2, 16, True, 1.0, 4.0, 25.0)
    err = _rel(u, ref)
    print(f"moe_routed N={N}: rel err {err:.2e}")
    assert u.dtype == torch.bfloat16 and u.shape == z.shape and err < BF16_BOUND


@pytest.fixture(scope="module")
def k3_case(k3_experts):
    """N -> (x, z, moe_sorted reference, rows whose top-16 selection is clear), built once per N."""
    g, b, w1, w3, w2 = k3_experts
    cache = {}

    def get(N):
        if N not in cache:
            gen = torch.Generator(device="cuda").manual_seed(100 + N)
            x = torch.randn(N, 7168, device="cuda", dtype=torch.bfloat16, generator=gen)
            z = torch.randn(N, 3584, device="cuda", dtype=torch.bfloat16, generator=gen)
            s = torch.sigmoid(x.float() @ g.float().T) + b
            top = torch.topk(s, 17, dim=-1).values
            ref = moe_sorted(x, z, g, b, w1, w3, w2, 16, True, 1.0, **SITU)
            cache[N] = (x, z, ref, (top[:, 15] - top[:, 16]) > 1e-5)
        return cache[N]
    return get


@pytest.mark.cuda
@pytest.mark.parametrize("tiles", _tiling_names())
def test_moe_tilings_k3_shapes(k3_experts, k3_case, tiles):
    """Every named tiling at K3 size vs moe_sorted, on the rows whose routing is clear (a near-tie may pick
    another expert under other rounding): prefill tilings at 2048 tokens (32768 pairs, ~37 rows per expert),
    decode tilings at 5 (the "pairs" ones at the most tokens they take), tilings with tail rows at 8192 (~146 rows
    per expert: the tail dot in use)."""
    from k3export.plugins.moe.kernels import TILINGS, moe_routed_fwd
    regime, name = tiles.split("-", 1)
    t = TILINGS[regime][name]
    x, z, ref, clear = k3_case(t.pairs or 5 if regime == "decode" else 8192 if t.tail else 2048)
    u = moe_routed_fwd(x, z, *k3_experts, 16, True, 1.0, tiles=TILINGS[regime][name], **SITU)
    err = ((u.double() - ref.double())[clear].abs().max() / ref.double().abs().max()).item()
    print(f"moe_routed tiles {tiles}: rel err {err:.2e} on {int(clear.sum())}/{len(clear)} clear rows")
    assert u.shape == z.shape and clear.float().mean() > 0.9 and err < BF16_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["m128t64-aw", "m128-tma-aw", "m64t32-n128-aw8", "m128t64-aw-k128"])
def test_moe_paired_gate_up_k3_shapes(k3_experts, k3_case, name):
    """gemm1 on gate/up rows interleaved (one [2 BN, BK] tile, one dot of N = 2 BN per step) vs the separate layout
    with the same tiling at K3 size, 8192 tokens (every expert hit, the tail dot in use), and vs moe_sorted."""
    from k3export.plugins.moe.kernels import TILINGS, interleave_gate_up, moe_routed_fwd
    g, b, w1, w3, w2 = k3_experts
    t = TILINGS["prefill"][name]
    x, z, ref, clear = k3_case(8192)
    if torch.cuda.mem_get_info()[0] < 45e9:
        pytest.skip("needs ~40 GB of free GPU memory for the interleaved copy of w1 / w3")
    sep = moe_routed_fwd(x, z, *k3_experts, 16, True, 1.0, tiles=t, **SITU)
    wp = (g, b, *interleave_gate_up(w1, w3)[1:], w2)
    u = moe_routed_fwd(x, z, *wp, 16, True, 1.0, tiles=t, **SITU)
    del wp
    torch.cuda.empty_cache()
    err_sep = _rel(u, sep)
    err = ((u.double() - ref.double())[clear].abs().max() / ref.double().abs().max()).item()
    print(f"moe_routed {name} paired gate/up: vs separate {err_sep:.2e} (bit-identical: {torch.equal(u, sep)}), "
          f"vs moe_sorted {err:.2e} on {int(clear.sum())}/{len(clear)} clear rows")
    # Same selection, same K order per output: at most h's bf16 rounding flips (~1 ulp, as between tilings).
    assert err_sep < BF16_BOUND and err < BF16_BOUND


@pytest.mark.cuda
def test_align_fused_k3_shapes():
    """The one-program align kernel gives the torch align's row plan at 896 experts (P = 16 .. 4096 pairs)."""
    from k3export.plugins.moe.kernels import align_rows
    gen = torch.Generator(device="cuda").manual_seed(5)
    for n, bm in ((1, 16), (64, 16), (256, 64)):
        ids = torch.argsort(torch.rand(n, 896, device="cuda", generator=gen), -1)[:, :16].int()
        ids[: n // 2, 0] = 7                                            # a hot expert
        a, b = align_rows(ids, 896, bm, fused=True), align_rows(ids, 896, bm, fused=False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (n, bm)


@pytest.mark.cuda
def test_align_chunked_k3_shapes():
    """The chunked align at 896 experts, 1 .. 16384 tokens top-16 (16 .. 262144 pairs), 16- to 192-row blocks: the
    torch plan exactly (both stable), a hot expert in every chunk."""
    from k3export.plugins.moe.kernels import ALIGN_CHUNK, align_rows
    gen = torch.Generator(device="cuda").manual_seed(8)
    for n, bm in ((1, 16), (300, 64), (4096, 128), (8192, 192), (16384, 128)):
        ids = torch.argsort(torch.rand(n, 896, device="cuda", generator=gen), -1)[:, :16].int()
        ids[: n // 4, 0] = 7                                            # a hot expert
        a, b = align_rows(ids, 896, bm, fused=False, chunked=ALIGN_CHUNK), align_rows(ids, 896, bm, fused=False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (n, bm)


@pytest.mark.cuda
def test_align_atomic_k3_shapes():
    """The count / scatter align at 896 experts, 4096 and 8192 tokens top-16 (65536 / 131072 pairs), 128- and
    192-row blocks: the torch plan up to the order inside each expert's rows."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    for n, bm in ((4096, 128), (8192, 192)):
        ids = torch.argsort(torch.rand(n, 896, device="cuda", generator=gen), -1)[:, :16].int()
        ids[: n // 4, 0] = 7                                            # a hot expert
        assert _plan_matches_up_to_order(ids, 896, bm), (n, bm)


@pytest.mark.cuda
@pytest.mark.parametrize("lean,N", [(False, 256), (True, 256), (True, 48)])
def test_route_k3_shapes(k3_experts, lean, N):
    from k3export.plugins.moe.kernels import route_fwd
    g, b = k3_experts[:2]
    x = torch.randn(N, 7168, device="cuda", dtype=torch.bfloat16)
    ids, w, _ = route_fwd(x, g, b, 16, True, 1.0, lean)
    rids, rw = route(x, g, b, 16, True, 1.0)
    same = (ids.long().sort(-1).values == rids.sort(-1).values).all(-1)
    s = torch.sigmoid(x.float() @ g.float().T) + b
    top = torch.topk(s, 17, dim=-1).values
    clear = (top[:, 15] - top[:, 16]) > 1e-5
    assert same[clear].all() and clear.float().mean() > 0.9
    wk = torch.gather(w, 1, torch.argsort(ids.long(), -1))
    wr = torch.gather(rw, 1, torch.argsort(rids, -1))
    assert (wk - wr)[clear].abs().max().item() < WEIGHT_BOUND


@pytest.mark.cuda
def test_moe_ties_hot_experts_gpu():
    """896 experts top-16 with pairs of identical experts (ties) and 16 hot experts that take every token
    (several 64-row blocks of one expert: prefill block_m); 880 experts receive no token. Small L/I: routing is
    the subject."""
    E, d, L, I = 896, 7168, 256, 384
    torch.manual_seed(11)
    g, b, w1, w3, w2 = _weights(E, d, L, I, torch.bfloat16, "cuda")
    for t in (g, b, w1, w3, w2):
        t[1::2] = t[0::2]
    b[100:116] = 50.0
    for N in (3, 1000):
        x = torch.randn(N, d, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(N, L, device="cuda", dtype=torch.bfloat16)
        u = torch.ops.k3.moe_routed(x, z, g, b, w1, w3, w2, 16, True, 1.0, 4.0, 25.0)
        err = _rel(u, moe_sorted(x, z, g, b, w1, w3, w2, 16, True, 1.0, 4.0, 25.0))
        print(f"moe_routed ties/hot N={N}: rel err {err:.2e}")
        assert err < BF16_BOUND


if __name__ == "__main__":
    print(json.dumps(_interpreter_cases()))
