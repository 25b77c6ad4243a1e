"""Triton MLA kernels (`plugins/mla/kernels.py`) against the plain-torch twins (`plugins/mla/naive.py`).

CPU: the kernels run under TRITON_INTERPRET=1 at tiny shapes, in fp32 and fp16 (triton 3.9's interpreter
computes bf16 `tl.dot` wrongly, so bf16 is checked on the GPU only). GPU (`cuda`): K3 shapes, 96 and 12 heads,
caches 1..64k, through `torch.ops.k3.*` (the registered CUDA kernels), bf16.

Error = max |kernel - reference| / max |reference|, the reference in fp64 (CPU) or fp32 (GPU) on the same inputs.
"""

from __future__ import annotations

import json
import math
import os

if __name__ == "__main__":  # the interpreter run (see `interp` in conftest.py): the flag must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from k3export.plugins.mla.naive import mla_decode_attention, mla_prefill_attention

# Named bounds. fp32: reordered fp32 sums over <= 576-wide dots and a few thousand rows.
FP32_BOUND = 1e-5
# fp16 (CPU): P and the output are rounded to fp16 once each (2^-11 relative), inputs shared with the reference.
FP16_BOUND = 3e-3
# bf16 (GPU): P and the output are rounded to bf16 once each (2^-8 relative each).
BF16_BOUND = 1e-2
# lse_part (log2 units, ~1..10 here): fp32 scores of 576-wide fp16 products and an fp32 running sum, against fp64.
LSE_BOUND = 1e-4
SCALE = 1.0 / math.sqrt(192)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _rel(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _interpreter_cases() -> dict:
    """Every CPU case, run in this process under TRITON_INTERPRET=1 -> {case: relative error}."""
    from k3export.plugins.mla.kernels import mla_decode_fwd, mla_prefill_fwd
    res = {}
    for name, dt in DTYPES.items():
        torch.manual_seed(0)
        B, H, R, L = 3, 5, 576, 70
        q, cache, row = (torch.randn(*s).to(dt) for s in ((B, H, R), (B, L, R), (B, R)))
        cache_len = torch.tensor([0, 37, 70])                  # empty cache, partial, full
        ref = mla_decode_attention(q.double(), cache.double(), row.double(), cache_len, SCALE, 512)
        # 8 splits of 70 rows: some are empty; 37: more than the combine's 16 per step, most of them empty
        for splits in (1, 3, 8, 37):
            out = mla_decode_fwd(q, cache, row, cache_len, SCALE, 512, num_splits=splits)
            assert out.dtype == dt and out.shape == (B, H, 512)
            res[f"decode-{name}-splits{splits}"] = _rel(out, ref)
        # one sequence: fewer (head, sequence) pairs than SMs, so the combine splits the 512 columns over 4 programs
        out = mla_decode_fwd(q[2:], cache[2:], row[2:], cache_len[2:], SCALE, 512, num_splits=37)
        res[f"decode-{name}-columns"] = _rel(out, ref[2:])
        torch.manual_seed(1)
        B, T, H, D, Dv, Lc = 2, 40, 3, 24, 16, 13              # D = 16 + 8: the split head dim, as 192 = 128 + 64
        q, k, v = (torch.randn(*s).to(dt) for s in ((B, T, H, D), (B, Lc + T, H, D), (B, Lc + T, H, Dv)))
        past_len = torch.tensor([5, 13])
        out = mla_prefill_fwd(q, k, v, past_len, 0.2)
        assert out.shape == (B, T, H, Dv) and out.dtype == dt
        res[f"prefill-{name}"] = _rel(out, mla_prefill_attention(q.double(), k.double(), v.double(), past_len, 0.2))
    q, k, v = (torch.randn(1, 33, 2, 16) for _ in range(3))
    out = mla_prefill_fwd(q, k, v, torch.tensor([0]), 0.25)    # no old rows at all
    res["prefill-fp32-no-old"] = _rel(out, mla_prefill_attention(q.double(), k.double(), v.double(),
                                                                  torch.tensor([0]), 0.25))
    res.update(_wide_cases())
    try:
        mla_decode_fwd(torch.randn(1, 2, 40), torch.randn(1, 4, 40), torch.randn(1, 39), torch.tensor([1]), 1.0, 32)
        res["bad-shape-named"] = 0.0
    except ValueError as e:
        res["bad-shape-named"] = float("new_row" in str(e))
    return res


WIDE_TILES = ("wide32", "wide64-tma", "trans128-tma")


def _wide_cases() -> dict:
    """The split kernel of the many-heads wide tiles (`DECODE_TILES`, kernel="wide"; the combine kernel is the
    base path's, tested above) at 96 heads (64 + a half-empty block of 32), fp16 (they take 16-bit inputs), one
    split per sequence: a cache of 1 row whose unused rows are NaN (a tile that read them would poison P.V) and
    one of 140 rows (full tiles from TMA row 140 on, then a partial one, for every block_n). Reference: softmax
    over the valid rows in fp64 and its log2-sum-exp (o_part, lse_part of the contract)."""
    from k3export.plugins.mla import kernels as K
    torch.manual_seed(2)
    B, H, R, L = 2, 96, 576, 140
    q, cache = torch.randn(B, H, R).half(), torch.randn(B, L, R).half()
    cache_len = torch.tensor([1, 140], dtype=torch.int32)
    cache[0, 1:] = float("nan")
    s = torch.einsum("bhr,blr->bhl", q.double(), torch.nan_to_num(cache.double(), nan=0.0)) * SCALE
    s = s.masked_fill(torch.arange(L)[None, None, :] >= cache_len[:, None, None].long(), float("-inf"))
    o_ref = torch.einsum("bhl,blv->bhv", torch.softmax(s, -1), torch.nan_to_num(cache.double(), nan=0.0)[..., :512])
    lse_ref = torch.logsumexp(s, -1) / math.log(2.0)
    res, prev = {}, dict(K.DECODE_CONFIG)
    try:
        for tile in WIDE_TILES:
            K.DECODE_CONFIG["many_heads_tile"] = tile
            o_part, lse_part = torch.empty(B, H, 1, 512), torch.empty(B, H, 1)
            K._launch_wide(q, cache, cache_len, 1, SCALE * K.LOG2E, 512, o_part, lse_part, K.decode_tiles(H))
            res[f"wide-{tile}"] = _rel(o_part[:, :, 0], o_ref)
            res[f"wide-{tile}-lse"] = (lse_part[:, :, 0].double() - lse_ref).abs().max().item()
    finally:
        K.DECODE_CONFIG.clear()
        K.DECODE_CONFIG.update(prev)
    return res


@pytest.mark.parametrize("case,bound", [(f"decode-{n}-{s}", b) for n, b in (("fp32", FP32_BOUND),
                                        ("fp16", FP16_BOUND)) for s in ("splits1", "splits3", "splits8", "splits37", "columns")]
                         + [("prefill-fp32", FP32_BOUND), ("prefill-fp16", FP16_BOUND),
                            ("prefill-fp32-no-old", FP32_BOUND)])
def test_interpreted(interp, case, bound):
    assert interp[case] < bound, interp


@pytest.mark.parametrize("tile", WIDE_TILES)
def test_interpreted_wide_tiles(interp, tile):
    assert interp[f"wide-{tile}"] < FP16_BOUND, interp
    assert interp[f"wide-{tile}-lse"] < LSE_BOUND, interp


def test_wide_tiles_are_opt_in_and_fill_rule():
    """`decode_tiles` (the TensorRT adapter's) stays on the base tile; eager / compiled calls take the wide tile for
    many heads from WIDE_MIN_ROWS cache rows (H200-measured crossover), never for fp32, few heads or traced
    launches; `fill` picks the split count with the fullest last wave."""
    from k3export.plugins.launch import traced_launches
    from k3export.plugins.mla import kernels as K
    assert K.decode_tiles(96).get("kernel", "base") == "base" and K.decode_tiles(12)["block_h"] == 16
    bf16 = torch.bfloat16
    assert K.decode_tile_for(32, 96, 8192, bf16) == K.DECODE_TILES[K.WIDE_TILE] and K.WIDE_MIN_ROWS == 1 << 17
    assert K.decode_tile_for(128, 96, 1024, bf16)["kernel"] == "wide"
    assert K.decode_tile_for(8, 96, 8192, bf16) == K.DECODE_TILES["many_heads"]            # 65536 rows: below
    assert K.decode_tile_for(32, 96, 8192, torch.float32) == K.DECODE_TILES["many_heads"]
    assert K.decode_tile_for(128, 16, 65536, bf16) == K.DECODE_TILES["few_heads"]
    with traced_launches():
        assert K.decode_tile_for(32, 96, 8192, bf16) == K.DECODE_TILES["many_heads"]
    assert K.split_rule(32, 96, 16384, 64, 132) == 5                  # 320 programs: 2.4 waves of 132
    assert K.split_rule(32, 96, 16384, 64, 132, fill=True) == 6       # 384 programs: 2.9 waves
    assert K.split_rule(1, 96, 1024, 64, 132, fill=True) == 16        # capped by min_chunk as before


def test_whole_wave_split_rule(monkeypatch):
    """`whole_wave_heads` (16 by default): up to that many heads, the most splits that keep the programs within one
    wave of SMs; more heads, or the rule off (0), keep two waves rounded up."""
    from k3export.plugins.mla import kernels as K
    assert K.DECODE_CONFIG["whole_wave_heads"] == 16
    assert K.split_rule(1, 12, 65536, 16, 132) == 132 and K.split_rule(32, 12, 65536, 16, 132) == 4
    assert K.split_rule(200, 12, 65536, 16, 132) == 1                  # more sequences than SMs: one split each
    assert K.split_rule(1, 16, 1024, 16, 132) == 16                    # still capped by min_chunk
    assert K.split_rule(64, 16, 1024, 16, 132) == 2                    # k3-small's MLA at B = 64 (5 with two waves)
    assert K.split_rule(1, 96, 65536, 32, 132) == 88                   # many heads: two waves
    monkeypatch.setitem(K.DECODE_CONFIG, "whole_wave_heads", 0)
    assert K.split_rule(1, 12, 65536, 16, 132) == 264 and K.split_rule(32, 12, 65536, 16, 132) == 9
    assert K.split_rule(64, 16, 1024, 16, 132) == 5


def test_bad_shapes_are_named(interp):
    assert interp["bad-shape-named"] == 1.0


# ---------------------------------------------------------------------------------------------- GPU, K3 shapes
@pytest.mark.cuda
@pytest.mark.parametrize("H", [96, 12])
@pytest.mark.parametrize("B,L", [(2, 1), (3, 1000), (2, 4097), (1, 65536), (2, 65536), (64, 2048)])
def test_decode_k3_shapes(H, B, L):
    torch.manual_seed(3)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, H, 576, device=dev, dtype=dt)
    cache = torch.randn(B, L, 576, device=dev, dtype=dt)
    row = torch.randn(B, 576, device=dev, dtype=dt)
    cache_len = torch.randint(0, L + 1, (B,), device=dev)
    cache_len[0] = L                                            # a full cache in every case
    if B > 1:
        cache_len[1] = 0                                        # and an empty one (only the new row)
    out = torch.ops.k3.mla_decode(q, cache, row, cache_len, SCALE, 512)
    ref = mla_decode_attention(q.float(), cache.float(), row.float(), cache_len, SCALE, 512)
    err = _rel(out, ref)
    print(f"mla_decode H={H} B={B} L={L}: rel err {err:.2e}")
    assert out.dtype == dt and err < BF16_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("tile", WIDE_TILES)
@pytest.mark.parametrize("B,L", [(2, 1), (3, 1000), (2, 4097), (1, 65536), (2, 65536), (64, 2048)])
def test_decode_wide_tiles_k3_shapes(tile, B, L, monkeypatch):
    """The many-heads wide tiles (not the default) through `torch.ops.k3.mla_decode` at 96 heads, bf16, with the
    rows past cache_len[b] set to NaN (the kernel must not read them; the reference gets zeros there)."""
    from k3export.plugins.mla import kernels as K
    monkeypatch.setitem(K.DECODE_CONFIG, "many_heads_tile", tile)
    torch.manual_seed(8)
    dev, dt, H = "cuda", torch.bfloat16, 96
    q = torch.randn(B, H, 576, device=dev, dtype=dt)
    cache = torch.randn(B, L, 576, device=dev, dtype=dt)
    row = torch.randn(B, 576, device=dev, dtype=dt)
    cache_len = torch.randint(0, L + 1, (B,), device=dev)
    cache_len[0] = L
    if B > 1:
        cache_len[1] = 0
    unused = torch.arange(L, device=dev)[None, :] >= cache_len[:, None]                        # [B, L]
    ref = mla_decode_attention(q.float(), cache.float().masked_fill(unused[..., None], 0.0), row.float(),
                               cache_len, SCALE, 512)
    out = torch.ops.k3.mla_decode(q, cache.masked_fill(unused[..., None], float("nan")), row, cache_len, SCALE, 512)
    err = _rel(out, ref)
    print(f"mla_decode {tile} H={H} B={B} L={L}: rel err {err:.2e}")
    assert out.dtype == dt and err < BF16_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("tile", WIDE_TILES)
def test_decode_wide_tiles_strided_cache(tile, monkeypatch):
    """A cache that is a slice of a longer buffer (not contiguous): the TMA tiles fall back to pointer loads."""
    from k3export.plugins.mla import kernels as K
    monkeypatch.setitem(K.DECODE_CONFIG, "many_heads_tile", tile)
    torch.manual_seed(9)
    B, L, dt = 3, 3000, torch.bfloat16
    q = torch.randn(B, 96, 576, device="cuda", dtype=dt)
    cache = torch.randn(B, L + 100, 576, device="cuda", dtype=dt)[:, :L]
    row = torch.randn(B, 576, device="cuda", dtype=dt)
    cache_len = torch.tensor([3000, 1234, 77], device="cuda")
    out = torch.ops.k3.mla_decode(q, cache, row, cache_len, SCALE, 512)
    ref = mla_decode_attention(q.float(), cache.float(), row.float(), cache_len, SCALE, 512)
    assert _rel(out, ref) < BF16_BOUND, _rel(out, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("H,B,T,Lc", [(96, 1, 1000, 500), (12, 2, 4096, 0), (12, 2, 300, 2000), (96, 2, 129, 7)])
def test_prefill_k3_shapes(H, B, T, Lc):
    torch.manual_seed(4)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, H, 192, device=dev, dtype=dt)
    k = torch.randn(B, Lc + T, H, 192, device=dev, dtype=dt)
    v = torch.randn(B, Lc + T, H, 128, device=dev, dtype=dt)
    past_len = torch.randint(0, Lc + 1, (B,), device=dev)
    past_len[0] = Lc
    out = torch.ops.k3.mla_prefill(q, k, v, past_len, SCALE)
    ref = mla_prefill_attention(q.float(), k.float(), v.float(), past_len, SCALE)
    err = _rel(out, ref)
    print(f"mla_prefill H={H} B={B} T={T} Lc={Lc}: rel err {err:.2e}")
    assert out.dtype == dt and err < BF16_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("tile", ["many_heads", "trans128-tma"])
def test_decode_fp32_gpu(tile, monkeypatch):
    """fp32 runs the base kernel, also when a wide tile (16-bit only) is selected."""
    from k3export.plugins.mla import kernels as K
    monkeypatch.setitem(K.DECODE_CONFIG, "many_heads_tile", tile)
    torch.manual_seed(5)
    q, cache, row = (torch.randn(*s, device="cuda") for s in ((2, 96, 576), (2, 3000, 576), (2, 576)))
    cache_len = torch.tensor([3000, 17], device="cuda")
    out = torch.ops.k3.mla_decode(q, cache, row, cache_len, SCALE, 512)
    ref = mla_decode_attention(q.double(), cache.double(), row.double(), cache_len, SCALE, 512)
    assert _rel(out, ref) < FP32_BOUND, _rel(out, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("H,B,L", [(96, 1, 4096), (12, 4, 1000)])
def test_decode_aot_launch_through_cupy(H, B, L):
    """The AOT contract (PTX, grid, params) launched by the CUDA driver == torch.ops.k3.mla_decode."""
    pytest.importorskip("cupy", reason="cupy launches the PTX through the CUDA driver")
    from k3export.plugins.aot import launch_cupy
    from k3export.plugins.mla.trt import decode_launches
    torch.manual_seed(6)
    q, cache, row = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((B, H, 576), (B, L, 576), (B, 576)))
    cache_len = torch.randint(0, L + 1, (B,), device="cuda")
    split, comb, inter = decode_launches(B, H, L, 576, 512, torch.bfloat16, SCALE,
                                         sms=torch.cuda.get_device_properties(0).multi_processor_count)
    t = {n: torch.empty(*shape, device="cuda", dtype=dt) for n, (shape, dt) in inter.items()}
    o = torch.empty(B, H, 512, device="cuda", dtype=torch.bfloat16)
    launch_cupy(split, dict(q=q, cache=cache, cache_len=cache_len, **t))
    launch_cupy(comb, dict(q=q, new_row=row, o=o, **t))
    ref = torch.ops.k3.mla_decode(q, cache, row, cache_len, SCALE, 512)
    assert _rel(o, ref) < 1e-6, _rel(o, ref)       # same kernels, same splits: equal up to nothing


@pytest.mark.cuda
def test_prefill_aot_launch_through_cupy():
    pytest.importorskip("cupy", reason="cupy launches the PTX through the CUDA driver")
    from k3export.plugins.aot import launch_cupy
    from k3export.plugins.mla.trt import prefill_launch
    torch.manual_seed(7)
    B, T, Lc, H = 2, 300, 100, 12
    q = torch.randn(B, T, H, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Lc + T, H, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Lc + T, H, 128, device="cuda", dtype=torch.bfloat16)
    past_len = torch.tensor([100, 40], device="cuda")
    o = torch.empty(B, T, H, 128, device="cuda", dtype=torch.bfloat16)
    launch_cupy(prefill_launch(B, T, Lc + T, H, 192, 128, torch.bfloat16, SCALE),
                dict(q=q, k=k, v=v, past_len=past_len, o=o))
    assert _rel(o, torch.ops.k3.mla_prefill(q, k, v, past_len, SCALE)) < 1e-6


if __name__ == "__main__":
    print(json.dumps(_interpreter_cases()))
