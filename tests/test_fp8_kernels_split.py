"""The weight-only FP8 GEMM's split-K sums (`k3export.fp8_kernels`): the in-launch sum ("fixup": the CTA that
finishes a column tile last sums its slices) against the second launch ("launch", `fp8_wo_reduce_kernel`), bit for
bit, and both against `fp8_linear_wo_ref`; the ticket counters left zero for the next call; the kernels compiled
for sm_90. Under the interpreter the programs run one at a time, in an order this file shuffles (the fixup must
not depend on which slice finishes last); on the GPU the CTAs race for real, and a CUDA graph replays the calls.

Errors are relative: ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random

if __name__ == "__main__":  # the interpreter run (see `test_split_sums_interpreter`): set before triton loads
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from k3export.fp8 import fp8_linear_wo_ref, quantize, scale_from_amax, weight_amax

# fp32 output: fp32 sums vs the reference's sums of the same exact E4M3 x fp32 products (tests/test_fp8.py).
FP32_BOUND = 1e-6
# The interpreter stores fp32 -> bf16 / fp16 by truncation (tests/test_fp8.py INTERP_BF16_BOUND): within one ulp
# of the fp32 reference, 2^-7 relative for bf16 (8-bit significand), 2^-10 for fp16 (11-bit).
INTERP_BOUND = {torch.float32: FP32_BOUND, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
# GPU: one round-to-nearest bf16 rounding plus fp32 summation order (tests/test_fp8.py BF16_OUT_BOUND, measured
# 1.6e-3 .. 1.7e-3 on the H200).
BF16_OUT_BOUND = 4e-3


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bit_mismatches(a, b) -> int:
    """Elements whose bits differ (so -0.0 vs +0.0 counts)."""
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.view(bits) != b.view(bits)).sum())


def _args(M, N, K, per_channel, g, dtype, device="cpu"):
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5
    ws = scale_from_amax(weight_amax(w, per_channel))
    return x.to(dtype).to(device), quantize(w, ws[:, None] if per_channel else ws).to(device), ws.to(device)


@contextlib.contextmanager
def program_order(order: str, seed: int = 0):
    """Run the interpreter's programs of every launch in this block in another order ("shuffled", "reversed")
    than its row-major loop: the loop's (x, y, z) are replaced by the next of a permutation of the grid. Relies on
    triton 3.9's `interpreter_builder.set_grid_dim / set_grid_idx` (fails loudly if they change). Yields a list
    that counts the permuted launches."""
    from triton.runtime.interpreter import interpreter_builder as b
    assert hasattr(b, "set_grid_dim") and hasattr(b, "set_grid_idx"), "triton's interpreter changed"
    rng, launches, state = random.Random(seed), [], {}
    set_dim, set_idx = b.set_grid_dim, b.set_grid_idx

    def grid_dim(nx, ny, nz):
        set_dim(nx, ny, nz)
        idx = list(itertools.product(range(nx), range(ny), range(nz)))
        if order == "shuffled":
            rng.shuffle(idx)
        else:
            idx.reverse()
        state["next"] = iter(idx)
        launches.append((nx, ny, nz))

    b.set_grid_dim = grid_dim
    b.set_grid_idx = lambda x, y, z: set_idx(*next(state["next"]))
    try:
        yield launches
    finally:
        del b.set_grid_dim, b.set_grid_idx


# (path, M, x dtype, tiles): the packed one-row GEMV (bf16), the byte kernel's one-row FMA path (fp16), the tl.dot
# path (2 rows: a 2-row block; 17 rows: a 32-row block; fp32 x: the tight bound); 64-wide K blocks so that a
# tiny K splits in up to 5 slices
def _cases():
    from k3export.fp8_kernels import WoTiles
    packed, byte = WoTiles(16, 64, 4, 1, 8, "shift", True), WoTiles(16, 64, 4, 1)
    return [("gemv4", 1, torch.bfloat16, packed), ("gemv", 1, torch.float16, byte),
            ("dot", 2, torch.bfloat16, byte), ("dot", 2, torch.float16, byte), ("dot", 17, torch.bfloat16, byte),
            ("dot", 17, torch.float16, byte), ("dot", 3, torch.float32, byte)]


def interp_results() -> dict:
    from k3export.fp8_kernels import fp8_linear_wo_fwd
    from k3export.plugins.triton_common import tickets
    out, g = {}, torch.Generator().manual_seed(7)
    # N = 24: 2 column tiles of 16, the last ragged; K = 600: slices of 600 / SPLIT rounded up to 64, the last one
    # shorter (splits 1, 2, 3, 5 stay 1, 2, 3, 5 after that rounding; the last slice has 280, 88, 88 of K)
    N, K = 24, 600
    for (path, M, dtype, t), split, pc in itertools.product(_cases(), (1, 2, 3, 5), (True, False)):
        tag = f"{path}_M{M}_{str(dtype)[6:]}_split{split}_{'pc' if pc else 'pt'}"
        x, wq, ws = _args(M, N, K, pc, g, dtype)
        with program_order("shuffled", seed=split) as launches:
            y = fp8_linear_wo_fwd(x, wq, ws, split=split, tiles=t, split_sum="fixup")
        out[f"launches:{tag}"] = len(launches)
        y2 = fp8_linear_wo_fwd(x, wq, ws, split=split, tiles=t, split_sum="launch")
        out[f"mismatch:{tag}"] = bit_mismatches(y, y2)
        out[f"err:{tag}"] = rel(y, fp8_linear_wo_ref(x.float(), wq, ws))
        if pc:      # (once per path and split) a second call in a row on the counters the first one left: fresh
            continue    # x, the programs in reverse (slice 0 finishes each tile)
        x = torch.randn(M, K, generator=g).to(dtype)
        with program_order("reversed"):
            y = fp8_linear_wo_fwd(x, wq, ws, split=split, tiles=t, split_sum="fixup")
        out[f"mismatch_again:{tag}"] = bit_mismatches(y, fp8_linear_wo_fwd(x, wq, ws, split=split, tiles=t,
                                                                            split_sum="launch"))
        out[f"err_again:{tag}"] = rel(y, fp8_linear_wo_ref(x.float(), wq, ws))
    # the default launch of a 1-row bf16 GEMM (the packed GEMV tiling, wo_split's 4 slices at the interpreter's 8
    # SMs, SPLIT_SUM) against the two-launch path
    x, wq, ws = _args(1, 72, 2048, True, g, torch.bfloat16)
    out["mismatch:default_vs_launch"] = bit_mismatches(fp8_linear_wo_fwd(x, wq, ws),
                                                       fp8_linear_wo_fwd(x, wq, ws, split_sum="launch"))
    out["counters_nonzero"] = int(tickets(torch.empty(0), 0).count_nonzero())
    return out


def test_split_sums_interpreter(interp):
    mism = {k: v for k, v in interp.items() if k.startswith("mismatch")}
    assert len(mism) == 7 * 4 * 3 + 1 and not any(mism.values()), mism       # bit for bit, every case
    # one launch each (no reduce launch), run in the shuffled order
    assert all(v == 1 for k, v in interp.items() if k.startswith("launches:")), interp
    errs = {k: v for k, v in interp.items() if k.startswith("err")}
    assert len(errs) == 7 * 4 * 3, errs
    for k, v in errs.items():
        assert v < INTERP_BOUND[getattr(torch, k.split("_")[-3])], (k, v)      # key: ..._<dtype>_split<S>_<scale>
    assert interp["counters_nonzero"] == 0, interp


def test_split_sum_rejects_unknown_names():
    from k3export.fp8_kernels import fp8_linear_wo_fwd
    x, wq, ws = _args(1, 16, 64, True, torch.Generator().manual_seed(0), torch.bfloat16)
    with pytest.raises(ValueError, match="split_sum 'atomic' is not one of"):
        fp8_linear_wo_fwd(x, wq, ws, split_sum="atomic")


def test_min_slice_only_bounds_the_split_from_below():
    # H200: 132 SMs. The default rule (4 CTAs per SM) splits k3-small's 2048 x 2048 in 3 (rounded to 2 slices of
    # 1024 by fp8_linear_wo_fwd); with 4096-element slices at least, only K >= 8192 splits.
    from k3export.fp8_kernels import GEMV_TILINGS, wo_split
    rule, s4096 = GEMV_TILINGS["p-n8k512-cvt-pf-c4"], GEMV_TILINGS["p-n8k512-cvt-pf-c4-s4096"]
    assert [wo_split(N, K, rule, 132) for N, K in ((2048, 2048), (576, 2048), (2048, 8192), (8192, 2048))] \
        == [3, 4, 3, 1]
    assert [wo_split(N, K, s4096, 132) for N, K in ((2048, 2048), (576, 2048), (2048, 8192), (576, 7168),
                                                    (576, 16384))] == [1, 1, 2, 1, 4]


def _gemv4_launch(split_sum):
    """(kernel, signature, constexprs, warps, stages) of the default packed one-row launch."""
    from k3export.fp8_kernels import GEMV, fp8_wo_gemv4_fwd_kernel
    t = GEMV
    sig = dict(x4="*i64", w4="*i32", w_scale="*fp32", y="*bf16", part="*fp32", count="*i32", N="i32", C="i32",
               C_SLICE="i32", stride_w4="i32", stride_ps="i32")
    cx = dict(PER_CHANNEL=True, SPLIT_SUM=split_sum, UNPACK=t.unpack, PREFETCH=t.prefetch, BLOCK_N=t.block_n,
              BLOCK_C=t.block_k // 4)
    return fp8_wo_gemv4_fwd_kernel, sig, cx, t.warps, t.stages


def _wo_launch(split_sum, gemv, block_m, dtype="bf16"):
    """The same for `fp8_wo_fwd_kernel`: the byte GEMV (BYTE_GEMV) or the tl.dot path (DOT_TILE, block_m rows)."""
    from k3export.fp8_kernels import BYTE_GEMV, DOT_TILE, fp8_wo_fwd_kernel
    t = BYTE_GEMV if gemv else DOT_TILE
    sig = dict(x=f"*{dtype}", w="*fp8e4nv", w_scale="*fp32", y=f"*{dtype}", part="*fp32", count="*i32", M="i32",
               N="i32", K="i32", K_SLICE="i32", stride_x="i32", stride_w="i32", stride_ym="i32", stride_ps="i32")
    cx = dict(PER_CHANNEL=False, SPLIT_SUM=split_sum, GEMV=gemv, DOT_PREC="tf32", WIDEN=False, BLOCK_M=block_m,
              BLOCK_N=t.block_n, BLOCK_K=t.block_k)
    return fp8_wo_fwd_kernel, sig, cx, t.warps, t.stages


LAUNCHES = {"gemv4": lambda m: _gemv4_launch(m), "byte_gemv_fp16": lambda m: _wo_launch(m, True, 1, "fp16"),
            "dot16": lambda m: _wo_launch(m, False, 16), "dot64": lambda m: _wo_launch(m, False, 64)}


def _ptx(fn, sig, cx, warps, stages):
    from k3export.plugins.aot import compile_ptx
    return compile_ptx(fn, {**sig, **{n: "constexpr" for n in cx}}, cx, num_warps=warps, num_stages=stages)


def _sum_order_ops(fn, sig, cx, warps, stages) -> list[str]:
    """The sm_90 TTGIR ops that fix the fp32 sums (loads, E4M3 converts, FMAs / dot, reductions, adds), SSA names
    dropped and layout aliases (#blocked1, #mma ...) replaced by their definitions."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(sig) + list(cx)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    src = ASTSource(fn, {**sig, **{n: "constexpr" for n in cx}}, cx, attrs)
    ir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    lines = [re.sub(r"\s*loc\([^)]*\)", "", line) for line in ir.asm["ttgir"].splitlines()]
    defs = dict(re.match(r"(#\w+) = (.*)", line).groups() for line in lines if re.match(r"#\w+ = ", line))
    pick = r"tt\.load|fp_to_fp|tt\.dot|warp_group_dot|tt\.reduce\b|arith\.addf|arith\.mulf|math\.fma"
    return [re.sub(r"#\w+", lambda m: defs.get(m.group(0), m.group(0)), re.sub(r"%[\w#]+", "%", line.strip()))
            for line in lines if re.search(pick, line)]


def test_fixup_kernels_compile_for_sm90_with_the_ordering_instructions():
    # the default launches in fixup mode: the packed GEMV, the byte GEMV, the tl.dot path at 16 and 64 rows. The
    # ticket is one gpu-scope acq_rel atomic add after a CTA barrier, the partials are read with L1-bypassing loads
    for name, launch in LAUNCHES.items():
        body = (k := _ptx(*launch("fixup"))).ptx[k.ptx.index(".entry"):]
        atom = body.index("atom.global.gpu.acq_rel.add")
        assert body.count("atom.global") == 1 and "bar.sync" in body[:atom], name
        cg = body.count("ld.global.cg")                     # 4 slices per step, 1+ loads per thread and slice
        assert cg and cg % 4 == 0 and body.index("ld.global.cg") > atom, name
    assert "atom." not in _ptx(*_gemv4_launch("launch")).ptx


def test_fixup_partials_compile_like_the_two_launch_partials():
    # GPU bit-identity of the partials: in sm_90 TTGIR, the two-launch kernel's summation-order ops (same layouts)
    # are exactly the first ops of the fixup kernel's, which then adds its slice sum
    for name, launch in LAUNCHES.items():
        two, one = _sum_order_ops(*launch("launch")), _sum_order_ops(*launch("fixup"))
        assert len(one) > len(two) and one[:len(two)] == two, name


# ------------------------------------------------------------------------------------------------ GPU

@pytest.mark.cuda
@pytest.mark.parametrize("M,N,K,split,dtype", [
    (1, 2048, 2048, None, torch.bfloat16), (1, 576, 2048, None, torch.bfloat16),      # k3-small: 2 and 4 slices
    (1, 2048, 8192, None, torch.bfloat16), (1, 2048, 2048, None, torch.float16),      # 3 slices; byte GEMV
    (1, 7168, 3584, 7, torch.bfloat16), (1, 576, 7168, None, torch.bfloat16),         # K3: 6272 CTAs; 7 slices
    (1, 7168, 12288, 5, torch.bfloat16), (4, 2048, 2048, None, torch.bfloat16),       # tl.dot path: 4 rows 8
    (17, 7168, 3584, 3, torch.bfloat16), (64, 3072, 2048, None, torch.float16)])      # slices, 17 rows, 64 rows 4
def test_fixup_equals_launch_bit_for_bit_cuda(M, N, K, split, dtype):
    from k3export.fp8_kernels import fp8_linear_wo_fwd
    from k3export.plugins.triton_common import tickets
    x, wq, ws = _args(M, N, K, True, torch.Generator().manual_seed(N + K + M), dtype, "cuda")
    want = fp8_linear_wo_fwd(x, wq, ws, split=split, split_sum="launch")
    runs = [fp8_linear_wo_fwd(x, wq, ws, split=split, split_sum="fixup") for _ in range(20)]   # CTAs race anew
    assert [bit_mismatches(y, want) for y in runs] == [0] * 20
    assert rel(runs[0], fp8_linear_wo_ref(x.float(), wq, ws)) < BF16_OUT_BOUND
    torch.cuda.synchronize()
    assert int(tickets(x, 0).count_nonzero()) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("M,N,K", [(1, 2048, 2048), (1, 576, 7168), (17, 2048, 8192)])
def test_fixup_in_a_cuda_graph_cuda(M, N, K):
    # 3 calls captured back to back (same counters, stream-ordered), replayed 3 times: every y equals the eager
    # two-launch result, bit for bit
    from k3export.fp8_kernels import fp8_linear_wo_fwd
    g = torch.Generator().manual_seed(N + M)
    x, wq, ws = _args(M, N, K, False, g, torch.bfloat16, "cuda")
    xs = [x] + [torch.randn(M, K, generator=g).bfloat16().cuda() for _ in range(2)]
    want = [fp8_linear_wo_fwd(a, wq, ws, split=4, split_sum="launch") for a in xs]
    fp8_linear_wo_fwd(x, wq, ws, split=4, split_sum="fixup")                       # counters exist before capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            [fp8_linear_wo_fwd(a, wq, ws, split=4, split_sum="fixup") for a in xs]
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [fp8_linear_wo_fwd(a, wq, ws, split=4, split_sum="fixup") for a in xs]
    for _ in range(3):
        for y in ys:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert [bit_mismatches(y, w) for y, w in zip(ys, want)] == [0, 0, 0]


if __name__ == "__main__":
    print(json.dumps(interp_results()))
