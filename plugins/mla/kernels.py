"""Triton MLA kernels: the CUDA implementations of `k3::mla_decode` and `k3::mla_prefill` (see CONTRACT.md).

Decode is latent MQA: every query head attends the same 576-wide rows, so one program takes BLOCK_H heads and
streams a chunk of the cache once for all of them (keys = whole row, values = its first v_dim columns, loaded
once and used twice). The cache length is split over programs (flash-decoding) so B = 1 at 64k fills the GPU;
a combine kernel merges the partial softmaxes and folds in the new row. Prefill is causal flash attention with
d_qk = 192 (loaded as 128 + 64) and d_v = 128 over the old rows (valid below past_len[b]) then the new rows.
Softmax runs in fp32 (base-2 exponent with the scale folded in); P is rounded to the value dtype for P.V.
Kernel parameters are ordered inputs..., scalars..., outputs... (TensorRT AOT plugins need that order).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..launch import launch, pdl_args, pdl_wait, size_bound, traced
from ..triton_common import check, dot_precision, pow2
from .op import mla_decode, mla_prefill

LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    return _num_sms(device.index or 0) if device.type == "cuda" else 8


# ---------------------------------------------------------------------------------------------- decode
# Split rule, and tiles per head count: the fastest of `k3export bench mla`'s sweep at B=32, L=16k on the H200
# (docs/perf.md). Keys set in DECODE_CONFIG (the bench's sweep does that) override the tiles.
# min_chunk: 256 until 2026-11-30; at B = 1 and short caches that left few programs with long serial loops
# (k3-small, 16 heads, 1024 rows: 4 splits of 256 rows, 13.7 us per call in the compiled decode step).
# whole_wave_heads (0 = off): up to this many heads (the few-heads tile, one program per SM) the splits fill exactly
# one wave instead of `waves` rounded up: fewer fp32 partials to write and combine. H200, scripts/mla_split_probe.py,
# CUDA-graph replays (2026-11-30 22:20): 12 heads B = 32, 64k rows 0.891 -> 0.657 ms (64% -> 87% of copy), 8k 0.127 ->
# 0.100; B = 8, 64k 0.190 -> 0.181; B = 1, 64k 0.070 -> 0.051; B = 128 equal (88.0 / 88.3% at 64k); k3-small's 16
# heads at 1k rows B = 16 0.030 -> 0.026, B = 64 0.054 -> 0.041 (8k: 0.222 -> 0.182); B = 1, 8k 0.027 / 0.029 with
# the same split count (noise). With many heads it was slower (96 heads, B = 8, 8k: +20%), so 16 heads at most.
DECODE_CONFIG = {"min_chunk": 64, "waves": 2, "whole_wave_heads": 16}
DECODE_TILES = {"few_heads": dict(block_h=16, block_n=64, num_warps=4, num_stages=3),    # H <= 16 (12 at TP=8)
                "many_heads": dict(block_h=32, block_n=32, num_warps=4, num_stages=3)}  # e.g. 96
# Candidates for many heads, `mla_decode_wide_kernel` (kernel="wide"; 16-bit inputs only, fp32 keeps the base
# kernel): 64 heads per program on two warpgroups (96 heads = 2 programs, the second half empty). Chosen with
# DECODE_CONFIG["many_heads_tile"] = name; not the default (untimed: scripts/mla_decode_sweep.py). Triton puts all
# warps of a dot that feeds another dot along M ([8, 1]), so with 64 rows of M both warpgroups compute the same
# scores: wide32 / wide64-tma do QK^T twice, in m64n16 / m64n32 wgmma steps that each re-read q from shared
# memory. trans128-tma computes S^T = K Q^T with 128 cache rows as M: each warpgroup its own 64 rows, m64n64
# steps, no repeat; but its 147 KB tile and q's 74 KB leave shared memory for one stage (no prefetch). Offline
# sm_90 builds (triton 3.6.0, ints specialised as the JIT does): wide32 246 registers, wide64-tma 233, 0 B
# spills; trans128-tma 255 registers, 208 B spills. The 96 = 64 + 32 split reads each tile twice (the two head
# blocks run side by side, so the second read can hit L2) and spends 1/4 of the MMA rows on padding.
DECODE_TILES |= {
    "wide32": dict(block_h=64, block_n=32, num_warps=8, num_stages=3, kernel="wide", tma=False, trans_s=False,
                   fill_waves=False),
    "wide64-tma": dict(block_h=64, block_n=64, num_warps=8, num_stages=2, kernel="wide", tma=True, trans_s=False,
                       fill_waves=False),
    "trans128-tma": dict(block_h=64, block_n=128, num_warps=8, num_stages=1, kernel="wide", tma=True, trans_s=True,
                         fill_waves=False),
    "wide64-tma-fill": dict(block_h=64, block_n=64, num_warps=8, num_stages=2, kernel="wide", tma=True,
                            trans_s=False, fill_waves=True),
}
# H200, 2026-11-30 09:47 (`scripts/mla_decode_sweep.py`, 96 heads, bf16, full caches; docs/perf.md): from B x L =
# 131072 cache rows on, wide64-tma-fill beats the base tile everywhere it was timed (B = 32, L = 64k: 1.92 vs
# 4.04 ms, 29.5% vs 14.0% of copy; B = 128, L = 8k: 0.98 vs 1.55; B = 8, L = 64k: 0.53 vs 0.57; B = 128, L = 1k:
# 0.180 vs 0.229; at B = 128, L = 64k wide64-tma without the fill rule is 2% faster still); below it (B = 8, L = 8k;
# B = 1, L = 64k; B <= 32, L = 1k) the base tile wins. So `mla_decode_fwd` takes WIDE_TILE for more than 16 heads
# from WIDE_MIN_ROWS rows (of cache capacity) in eager / compiled calls; traced launches (AOTI) and the TensorRT
# adapter keep `decode_tiles`' tile, and DECODE_CONFIG["many_heads_tile"], when set, overrides both.
WIDE_TILE, WIDE_MIN_ROWS = "wide64-tma-fill", 1 << 17


@triton.jit
def _split_setup(q, cache_len, stride_qb, stride_qh, H, num_splits, V_DIM, R, BLOCK_H: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_PE: tl.constexpr):
    """A split program's (head block, split, sequence): b, the split index, its cache rows [start, end) (chunks
    rounded up to BLOCK_N rows) and the end of its last full BLOCK_N tile, its heads with their mask, the value /
    rope column offsets with their masks, and its query rows q_v `[BH, BV]`, q_pe `[BH, BPE]`."""
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2)
    n = tl.load(cache_len + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    start = pid_s * chunk
    end = tl.minimum(start + chunk, n)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_v = tl.arange(0, BLOCK_V)
    offs_pe = V_DIM + tl.arange(0, BLOCK_PE)
    v_ok = offs_v < V_DIM
    pe_ok = offs_pe < R
    q_row = q + b * stride_qb + heads[:, None] * stride_qh
    q_v = tl.load(q_row + offs_v[None, :], mask=h_ok[:, None] & v_ok[None, :], other=0.0)     # [BH, BV]
    q_pe = tl.load(q_row + offs_pe[None, :], mask=h_ok[:, None] & pe_ok[None, :], other=0.0)  # [BH, BPE]
    return b, pid_s, start, end, full_end, heads, h_ok, offs_v, offs_pe, v_ok, pe_ok, q_v, q_pe


@triton.jit
def _store_partial(o_part, lse_part, acc, m_i, l_i, b, pid_s, H, num_splits, heads, h_ok, offs_v,
                   BLOCK_V: tl.constexpr):
    """The split's normalised partial output and its log2-sum-exp (-inf when it saw no row) to o_part / lse_part."""
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = (b * H + heads) * num_splits + pid_s                                                 # [BH]
    tl.store(o_part + part[:, None].to(tl.int64) * BLOCK_V + offs_v[None, :], out, mask=h_ok[:, None])
    tl.store(lse_part + part, lse, mask=h_ok)


@triton.jit
def mla_decode_fwd_kernel(q, cache, cache_len,
                          stride_qb, stride_qh, stride_cb, stride_cl,
                          H, num_splits, qk_scale, V_DIM, R,
                          o_part, lse_part,
                          BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                          BLOCK_PE: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr = False):
    """One (head block, split, sequence): partial softmax over cache rows [start, end) of sequence b.

    o_part `[B, H, S, BLOCK_V]` fp32 (normalised partial output), lse_part `[B, H, S]` fp32 (log2 domain;
    -inf for an empty split). PDL: wait for the stream predecessor first (`launch.pdl_args`)."""
    pdl_wait(PDL)
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes Python float arguments as fp64 (AOTI packages)
    b, pid_s, start, end, _, heads, h_ok, offs_v, offs_pe, v_ok, pe_ok, q_v, q_pe = _split_setup(
        q, cache_len, stride_qb, stride_qh, H, num_splits, V_DIM, R, BLOCK_H, BLOCK_N, BLOCK_V, BLOCK_PE)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    c_base = cache + b.to(tl.int64) * stride_cb
    for j0 in range(start, end, BLOCK_N):
        rows = j0 + tl.arange(0, BLOCK_N)
        r_ok = rows < end
        c_row = c_base + rows[:, None].to(tl.int64) * stride_cl
        kv = tl.load(c_row + offs_v[None, :], mask=r_ok[:, None] & v_ok[None, :], other=0.0)     # [BN, BV]
        k_pe = tl.load(c_row + offs_pe[None, :], mask=r_ok[:, None] & pe_ok[None, :], other=0.0)  # [BN, BPE]
        s = tl.dot(q_v, tl.trans(kv), input_precision=DOT_PREC)
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=DOT_PREC)                       # [BH, BN]
        s = tl.where(r_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(kv.dtype), kv, acc=acc, input_precision=DOT_PREC)
        m_i = m_new

    _store_partial(o_part, lse_part, acc, m_i, l_i, b, pid_s, H, num_splits, heads, h_ok, offs_v, BLOCK_V)


@triton.jit
def mla_decode_combine_kernel(q, new_row, o_part, lse_part,
                              stride_qb, stride_qh, stride_nb, stride_ob, stride_oh,
                              H, num_splits, qk_scale, V_DIM, R,
                              o,
                              BLOCK_V: tl.constexpr, BLOCK_PE: tl.constexpr, BLOCK_S: tl.constexpr,
                              PDL: tl.constexpr = False, BLOCK_C: tl.constexpr = 16,
                              BLOCK_VC: tl.constexpr = 128):
    """One (head, sequence, block of BLOCK_VC output columns): merge the split partials and the always-attended
    new row, BLOCK_C splits per step (a [BLOCK_C, BLOCK_VC] tile of o_part: at B = 1 and 64k rows S is in the
    hundreds, and one split per step was a serial chain of S loads). PDL: as the decode kernel."""
    pdl_wait(PDL)
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes Python float arguments as fp64 (AOTI packages)
    h = tl.program_id(0)
    b = tl.program_id(1)
    offs_f = tl.arange(0, BLOCK_V)                                        # the whole latent, for the new score
    offs_v = tl.program_id(2) * BLOCK_VC + tl.arange(0, BLOCK_VC)         # this program's output columns
    offs_pe = V_DIM + tl.arange(0, BLOCK_PE)
    f_ok = offs_f < V_DIM
    v_ok = offs_v < V_DIM
    pe_ok = offs_pe < R
    q_b = q + b * stride_qb + h * stride_qh
    r_b = new_row + b * stride_nb
    q_f = tl.load(q_b + offs_f, mask=f_ok, other=0.0).to(tl.float32)
    q_pe = tl.load(q_b + offs_pe, mask=pe_ok, other=0.0).to(tl.float32)
    r_f = tl.load(r_b + offs_f, mask=f_ok, other=0.0).to(tl.float32)
    r_pe = tl.load(r_b + offs_pe, mask=pe_ok, other=0.0).to(tl.float32)
    s_new = (tl.sum(q_f * r_f, 0) + tl.sum(q_pe * r_pe, 0)) * qk_scale

    base = (b * H + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_part + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.maximum(tl.max(lse, 0), s_new)
    w_new = tl.exp2(s_new - m)
    acc = w_new * tl.load(r_b + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    den = w_new
    offs_c = tl.arange(0, BLOCK_C)
    for s0 in range(0, num_splits, BLOCK_C):
        sc = s0 + offs_c
        c_ok = sc < num_splits
        w = tl.exp2(tl.load(lse_part + base + sc, mask=c_ok, other=float("-inf")) - m)          # 0 for empty
        part = tl.load(o_part + (base + sc)[:, None].to(tl.int64) * BLOCK_V + offs_v[None, :],
                       mask=c_ok[:, None] & v_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
        den += tl.sum(w, 0)
    tl.store(o + b * stride_ob + h * stride_oh + offs_v, (acc / den).to(o.dtype.element_ty), mask=v_ok)


# The combine's tile. Columns per program: with fewer (head, sequence) programs than SMs (B = 1: H programs) the
# 512 columns go to four programs of 128 each; with more, one program takes all 512 (four would each reload q and
# the new row for their own score: at 96 heads, B = 128 that was 1.9x slower). Splits per step: up to 16.
COMBINE_VC, COMBINE_C = 128, 16


def combine_tile(H: int, B, S: int, block_v: int, sms: int) -> dict:
    """BLOCK_VC, BLOCK_C of the combine launch for H heads, batch B (a shape expression counts as small), S
    splits."""
    few = not isinstance(B, int) or H * B < sms
    return dict(BLOCK_VC=min(COMBINE_VC, block_v) if few else block_v, BLOCK_C=min(COMBINE_C, pow2(S, 2)))


def combine_grid(H: int, B, block_v: int, block_vc: int) -> tuple:
    """The combine launch's grid (B may be a shape expression)."""
    return (H, B, block_v // block_vc)


# The "wide" split kernel for many heads (a DECODE_TILES entry with kernel="wide"; not the default until timed on
# the H200, `scripts/mla_decode_sweep.py`). 64 heads per program and 8 warps: Triton lays the [64, 512] fp32
# accumulator over two warpgroups (256 value columns each, 128 registers per thread) and issues wgmma; q stays in
# shared memory. Full cache tiles load unmasked (TMA descriptors with tma=True, else pointer loads that the
# software pipeliner turns into cp.async); the last, partial tile of a split is a masked pointer load, so rows at
# or past cache_len[b] are never read (they may hold anything, NaN included: a TMA tile would multiply them by
# p = 0 in P.V).
@triton.jit
def _decode_tile(acc, m_i, l_i, q_v, q_pe, kv, k_pe, r_ok, qk_scale, MASKED: tl.constexpr,
                 TRANS_S: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online softmax over one cache tile for a head block: kv `[BN, BV]` (keys' first part, and the values),
    k_pe `[BN, BPE]`; with MASKED, rows where r_ok `[BN]` is False get zero weight. TRANS_S computes the scores
    as S^T = K Q^T, cache rows as the MMA's M (wgmma needs BN >= 64; see DECODE_TILES)."""
    if TRANS_S:
        st = tl.dot(kv, tl.trans(q_v), input_precision=DOT_PREC)
        st = tl.dot(k_pe, tl.trans(q_pe), acc=st, input_precision=DOT_PREC)                    # [BN, BH]
        s = tl.trans(st) * qk_scale
    else:
        s = tl.dot(q_v, tl.trans(kv), input_precision=DOT_PREC)
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=DOT_PREC) * qk_scale            # [BH, BN]
    if MASKED:
        s = tl.where(r_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    acc = tl.dot(p.to(kv.dtype), kv, acc=acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def mla_decode_wide_kernel(q, cache, cache_len, kv_desc, pe_desc,
                           stride_qb, stride_qh, stride_cb, stride_cl,
                           H, num_splits, qk_scale, V_DIM, R,
                           o_part, lse_part,
                           BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                           BLOCK_PE: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
                           TRANS_S: tl.constexpr, PDL: tl.constexpr = False):
    """`mla_decode_fwd_kernel`'s contract (same grid, splits and outputs). With TMA, kv_desc / pe_desc are
    descriptors of the cache as `[B * L, R]` (contiguous) with blocks `[BLOCK_N, BLOCK_V]` / `[BLOCK_N,
    BLOCK_PE]`, BLOCK_V == V_DIM and BLOCK_PE == R - V_DIM; else they are unused (None). TRANS_S: see
    `_decode_tile`. PDL: as `mla_decode_fwd_kernel`."""
    pdl_wait(PDL)
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes Python float arguments as fp64 (AOTI packages)
    b, pid_s, start, end, full_end, heads, h_ok, offs_v, offs_pe, v_ok, pe_ok, q_v, q_pe = _split_setup(
        q, cache_len, stride_qb, stride_qh, H, num_splits, V_DIM, R, BLOCK_H, BLOCK_N, BLOCK_V, BLOCK_PE)
    offs_n = tl.arange(0, BLOCK_N)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    c_base = cache + b.to(tl.int64) * stride_cb
    row0 = b * (stride_cb // stride_cl)                                                         # TMA row of (b, 0)
    for j0 in range(start, full_end, BLOCK_N):
        if TMA:
            kv = kv_desc.load([row0 + j0, 0])                                                   # [BN, BV]
            k_pe = pe_desc.load([row0 + j0, V_DIM])                                             # [BN, BPE]
        else:
            c_row = c_base + (j0 + offs_n)[:, None].to(tl.int64) * stride_cl
            kv = tl.load(c_row + offs_v[None, :], mask=v_ok[None, :], other=0.0)
            k_pe = tl.load(c_row + offs_pe[None, :], mask=pe_ok[None, :], other=0.0)
        acc, m_i, l_i = _decode_tile(acc, m_i, l_i, q_v, q_pe, kv, k_pe, offs_n < BLOCK_N, qk_scale, False,
                                     TRANS_S, DOT_PREC)
    if full_end < end:                                                                          # partial tile
        rows = full_end + offs_n
        r_ok = rows < end
        c_row = c_base + rows[:, None].to(tl.int64) * stride_cl
        kv = tl.load(c_row + offs_v[None, :], mask=r_ok[:, None] & v_ok[None, :], other=0.0)
        k_pe = tl.load(c_row + offs_pe[None, :], mask=r_ok[:, None] & pe_ok[None, :], other=0.0)
        acc, m_i, l_i = _decode_tile(acc, m_i, l_i, q_v, q_pe, kv, k_pe, r_ok, qk_scale, True, TRANS_S, DOT_PREC)

    _store_partial(o_part, lse_part, acc, m_i, l_i, b, pid_s, H, num_splits, heads, h_ok, offs_v, BLOCK_V)


def split_rule(B: int, H: int, L: int, block_h: int, sms: int, fill: bool = False) -> int:
    """Splits of the cache length: enough programs for `waves` per SM (up to `whole_wave_heads` heads: as many as
    fit one wave), no chunk under `min_chunk` rows (the AOT adapter, trt.py, calls it with a fixed SM
    count). fill (the wide tiles' `fill_waves`, for kernels that run one program per SM at a time): of the counts
    from there up to twice it, the one whose last wave is fullest (B = 32, 96 heads in blocks of 64: 6 splits, 384
    programs = 2.9 waves of 132, instead of 5 = 2.4 waves)."""
    cfg = DECODE_CONFIG
    programs = B * triton.cdiv(H, block_h)
    want = triton.cdiv(cfg["waves"] * sms, programs)
    if H <= cfg["whole_wave_heads"]:  # the few-heads tile: the most splits that fit one wave (see DECODE_CONFIG)
        want = max(1, sms // programs)
    most = triton.cdiv(max(L, 1), cfg["min_chunk"])
    n = max(1, min(want, most))
    if fill:
        full = lambda k: programs * k / (triton.cdiv(programs * k, sms) * sms)                 # last wave's use
        n = max(range(n, max(n, min(2 * want - 1, most)) + 1), key=lambda k: (full(k), -k))
    return n


def decode_splits(B: int, H: int, L: int, block_h: int, device: torch.device, fill: bool = False) -> int:
    """`split_rule` with the SM count of `device`."""
    return split_rule(B, H, L, block_h, _sm_count(device), fill)


def decode_tiles(H: int) -> dict:
    """block_h (heads per program: each latent row is read once per head block, so larger reads less until the
    fp32 accumulator `[BLOCK_H, 512]` no longer fits the registers), block_n, num_warps, num_stages; for more
    than 16 heads the tile DECODE_CONFIG["many_heads_tile"] names (default "many_heads"), whose entries
    DECODE_CONFIG may override."""
    t = dict(DECODE_TILES["few_heads" if H <= 16 else DECODE_CONFIG.get("many_heads_tile", "many_heads")])
    t.update({k: DECODE_CONFIG[k] for k in t if k in DECODE_CONFIG})
    return t


def decode_tile_for(B: int, H: int, L: int, dtype: torch.dtype) -> dict:
    """The tile an eager or compiled `mla_decode` call runs: `decode_tiles(H)`, or WIDE_TILE for more than 16
    heads from WIDE_MIN_ROWS rows of cache capacity B x L (not in traced launches, which cannot build its TMA
    descriptors, nor when DECODE_CONFIG names a many-heads tile); the base tile for fp32 (the wide kernel takes
    16-bit inputs)."""
    cfg = decode_tiles(H)
    if H > 16 and "many_heads_tile" not in DECODE_CONFIG and size_bound(B) * size_bound(L) >= WIDE_MIN_ROWS and \
            not traced():
        cfg = dict(DECODE_TILES[WIDE_TILE])
    if dtype == torch.float32 and cfg.get("kernel") == "wide":
        cfg = dict(DECODE_TILES["many_heads"])
    return cfg


def decode_block_h(H: int) -> int:
    return decode_tiles(H)["block_h"]


def _launch_wide(q, cache, cache_len, S: int, qk_scale: float, v_dim: int, o_part, lse_part, cfg: dict):
    """The split launch of `mla_decode_wide_kernel` for tile `cfg` (q, cache `[B, *, R]`, unit last stride).
    TMA needs a contiguous, 16-byte aligned cache and power-of-two v_dim and R - v_dim (the descriptors' blocks
    are exact); otherwise the same tile runs with pointer loads. The descriptors are built on the host per call
    (host time; a `wrap_triton` trace of them is untested: the wide tiles are not the default)."""
    B, H, R = q.shape
    BV, BPE, bn = pow2(v_dim), pow2(R - v_dim), cfg["block_n"]
    tma = (cfg.get("tma") and cache.is_contiguous() and cache.numel() > 0 and cache.data_ptr() % 16 == 0
           and BV == v_dim and BPE == R - v_dim)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        rows = cache.view(-1, R)                                                                # [B * L, R]
        kv_desc, pe_desc = TensorDescriptor.from_tensor(rows, [bn, BV]), TensorDescriptor.from_tensor(rows, [bn, BPE])
    else:
        kv_desc = pe_desc = None
    launch(mla_decode_wide_kernel)[(triton.cdiv(H, cfg["block_h"]), S, B)](
        q, cache, cache_len, kv_desc, pe_desc, q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
        H, S, qk_scale, v_dim, R, o_part, lse_part, BLOCK_H=cfg["block_h"], BLOCK_N=bn, BLOCK_V=BV, BLOCK_PE=BPE,
        DOT_PREC=dot_precision(q.dtype), TMA=bool(tma), TRANS_S=cfg.get("trans_s", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_args(q))


def mla_decode_fwd(q, cache, new_row, cache_len, scale: float, v_dim: int, num_splits: int | None = None):
    """q `[B, H, R]`, cache `[B, L, R]`, new_row `[B, R]`, cache_len `[B]` -> o `[B, H, v_dim]` in q.dtype."""
    B, H, R = q.shape
    L = cache.shape[1]
    check(cache.shape[0] == B and cache.shape[2] == R, f"mla_decode: cache {tuple(cache.shape)} must be "
          f"[B={B}, L, R={R}] like q {tuple(q.shape)}")
    check(new_row.shape == (B, R), f"mla_decode: new_row {tuple(new_row.shape)} must be [{B}, {R}]")
    check(0 < v_dim < R, f"mla_decode: v_dim {v_dim} must be in (0, R={R})")
    check(q.dtype == cache.dtype == new_row.dtype, f"mla_decode: q/cache/new_row dtypes differ: "
          f"{q.dtype}, {cache.dtype}, {new_row.dtype}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    cache = cache if cache.stride(-1) == 1 else cache.contiguous()
    new_row = new_row.contiguous()
    cache_len = cache_len.clamp(0, L).to(torch.int32)
    fp32 = q.dtype == torch.float32
    cfg = decode_tile_for(B, H, L, q.dtype)
    block_h = cfg["block_h"]
    S = num_splits or decode_splits(B, H, L, block_h, q.device, cfg.get("fill_waves", False))
    BV, BPE = pow2(v_dim), pow2(R - v_dim)
    o_part = torch.empty(B, H, S, BV, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    o = torch.empty(B, H, v_dim, device=q.device, dtype=q.dtype)
    qk_scale = scale * LOG2E
    if cfg.get("kernel") == "wide":
        _launch_wide(q, cache, cache_len, S, qk_scale, v_dim, o_part, lse_part, cfg)
    else:
        launch(mla_decode_fwd_kernel)[(triton.cdiv(H, block_h), S, B)](
            q, cache, cache_len, q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
            H, S, qk_scale, v_dim, R, o_part, lse_part, BLOCK_H=block_h, BLOCK_N=16 if fp32 else cfg["block_n"],
            BLOCK_V=BV, BLOCK_PE=BPE, DOT_PREC=dot_precision(q.dtype), num_warps=cfg["num_warps"],
            num_stages=1 if fp32 else cfg["num_stages"], **pdl_args(q))
    ct = combine_tile(H, B, S, BV, _sm_count(q.device))
    launch(mla_decode_combine_kernel)[combine_grid(H, B, BV, ct["BLOCK_VC"])](
        q, new_row, o_part, lse_part, q.stride(0), q.stride(1), new_row.stride(0), o.stride(0), o.stride(1),
        H, S, qk_scale, v_dim, R, o, BLOCK_V=BV, BLOCK_PE=BPE, BLOCK_S=pow2(S, 2), **ct, num_warps=4,
        **pdl_args(q))
    return o


# ---------------------------------------------------------------------------------------------- prefill
PREFILL_CONFIG = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}


@triton.jit
def _attend_block(acc, m_i, l_i, q_a, q_b, k_ptr, v_ptr, cols, ok, stride_ks, stride_vs, qk_scale,
                  offs_a, offs_b, offs_v, D_QK, D_V, HAS_B: tl.constexpr, DOT_PREC: tl.constexpr):
    """One key block of online softmax: ok `[BM, BN]` masks scores; cols `[BN]` are row indices into k/v."""
    col_ok = tl.max(ok.to(tl.int32), 0) > 0
    k_row = k_ptr + cols[:, None].to(tl.int64) * stride_ks
    k_a = tl.load(k_row + offs_a[None, :], mask=col_ok[:, None], other=0.0)
    s = tl.dot(q_a, tl.trans(k_a), input_precision=DOT_PREC)
    if HAS_B:
        k_b = tl.load(k_row + offs_b[None, :], mask=col_ok[:, None] & (offs_b[None, :] < D_QK), other=0.0)
        s = tl.dot(q_b, tl.trans(k_b), acc=s, input_precision=DOT_PREC)
    s = tl.where(ok, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    v = tl.load(v_ptr + cols[:, None].to(tl.int64) * stride_vs + offs_v[None, :],
                mask=col_ok[:, None] & (offs_v[None, :] < D_V), other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def mla_prefill_fwd_kernel(q, k, v, past_len,
                           stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                           stride_vb, stride_vs, stride_vh, stride_ob, stride_ot, stride_oh,
                           T, S, H, qk_scale, D_QK, D_V,
                           o,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr,
                           BLOCK_B: tl.constexpr, HAS_B: tl.constexpr, BLOCK_V: tl.constexpr,
                           DOT_PREC: tl.constexpr):
    """One (query block, sequence x head): old rows j < min(past_len[b], S - T) unmasked, then new rows
    causally (new row j' visible to query i when j' <= i). Head dim split as BLOCK_A (pow2) + BLOCK_B."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes Python float arguments as fp64 (AOTI packages)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    old = S - T
    n_old = tl.minimum(tl.load(past_len + b).to(tl.int32), old)
    n_old = tl.maximum(n_old, 0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T
    offs_a = tl.arange(0, BLOCK_A)
    offs_b = BLOCK_A + tl.arange(0, BLOCK_B)
    offs_v = tl.arange(0, BLOCK_V)
    q_row = q + b.to(tl.int64) * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qt
    q_a = tl.load(q_row + offs_a[None, :], mask=m_ok[:, None], other=0.0)
    q_b = tl.load(q_row + offs_b[None, :], mask=m_ok[:, None] & (offs_b[None, :] < D_QK), other=0.0)
    k_ptr = k + b.to(tl.int64) * stride_kb + h * stride_kh
    v_ptr = v + b.to(tl.int64) * stride_vb + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for j0 in range(0, n_old, BLOCK_N):
        cols = j0 + offs_n
        ok = (cols[None, :] < n_old) & (offs_m[:, None] >= 0)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q_a, q_b, k_ptr, v_ptr, cols, ok, stride_ks, stride_vs,
                                      qk_scale, offs_a, offs_b, offs_v, D_QK, D_V, HAS_B, DOT_PREC)
    hi = tl.minimum(T, (pid_m + 1) * BLOCK_M)
    for j0 in range(0, hi, BLOCK_N):
        cols = j0 + offs_n
        ok = (cols[None, :] <= offs_m[:, None]) & (cols[None, :] < T)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q_a, q_b, k_ptr, v_ptr, old + cols, ok, stride_ks,
                                      stride_vs, qk_scale, offs_a, offs_b, offs_v, D_QK, D_V, HAS_B, DOT_PREC)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_row = o + b.to(tl.int64) * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_ot
    tl.store(o_row + offs_v[None, :], out.to(o.dtype.element_ty), mask=m_ok[:, None] & (offs_v[None, :] < D_V))


def prefill_head_blocks(D: int) -> dict:
    """The Dqk split of the prefill kernel: BLOCK_A, the largest power of two <= D (at least 16), plus a second
    block BLOCK_B (HAS_B) for the rest, e.g. 192 = 128 + 64 (shared with the AOT adapter, trt.py)."""
    block_a = 1 << (D.bit_length() - 1)
    rest = D - block_a
    return dict(BLOCK_A=max(block_a, 16), BLOCK_B=pow2(max(rest, 1)), HAS_B=rest > 0)


def mla_prefill_fwd(q, k, v, past_len, scale: float):
    """q `[B, T, H, Dqk]`, k `[B, S, H, Dqk]`, v `[B, S, H, Dv]`, past_len `[B]` -> o `[B, T, H, Dv]`."""
    B, T, H, D = q.shape
    S = k.shape[1]
    check(k.shape == (B, S, H, D) and S >= T, f"mla_prefill: k {tuple(k.shape)} must be [B={B}, S>=T={T}, "
          f"H={H}, Dqk={D}]")
    check(v.shape[:3] == (B, S, H), f"mla_prefill: v {tuple(v.shape)} must be [{B}, {S}, {H}, Dv]")
    check(q.dtype == k.dtype == v.dtype, f"mla_prefill: q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    check(D >= 16, f"mla_prefill kernel: Dqk must be >= 16, got {D} (the op keeps the reference below that)")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    Dv = v.shape[-1]
    o = torch.empty(B, T, H, Dv, device=q.device, dtype=q.dtype)
    if T == 0:
        return o
    cfg = PREFILL_CONFIG
    fp32 = q.dtype == torch.float32
    block_m = min(cfg["block_m"], pow2(size_bound(T))) if not fp32 else 32
    block_n = cfg["block_n"] if not fp32 else 32
    launch(mla_prefill_fwd_kernel)[(triton.cdiv(T, block_m), B * H)](
        q, k, v, past_len.to(torch.int32), *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        T, S, H, scale * LOG2E, D, Dv, o, BLOCK_M=block_m, BLOCK_N=block_n, **prefill_head_blocks(D),
        BLOCK_V=pow2(Dv), DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg["num_warps"] if not fp32 else 4, num_stages=cfg["num_stages"] if not fp32 else 1)
    return o


# ---------------------------------------------------------------------------------------------- registration
# Float64 calls (validation runs) keep the reference: the kernels compute in fp32.
@mla_decode.register_kernel("cuda")
def _(q, cache, new_row, cache_len, scale, v_dim):
    if torch.float64 in (q.dtype, cache.dtype):
        return mla_decode._init_fn(q, cache, new_row, cache_len, scale, v_dim)
    return mla_decode_fwd(q, cache, new_row, cache_len, scale, v_dim)


@mla_prefill.register_kernel("cuda")
def _(q, k, v, past_len, scale):
    if q.dtype == torch.float64 or q.shape[-1] < 16:     # the q/k tile loads assume Dqk >= 16 (unmasked)
        return mla_prefill._init_fn(q, k, v, past_len, scale)
    return mla_prefill_fwd(q, k, v, past_len, scale)
