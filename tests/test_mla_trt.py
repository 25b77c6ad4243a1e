"""The TensorRT side of the MLA kernels (`plugins/mla/trt.py`): the `tensorrt.plugin` registration and the wrapper
kernels it launches.

CPU, no GPU: `register_plugins` runs against a stand-in of `tensorrt.plugin` with its registration checks
(tests/trt_standin.py); each plugin's output descriptors, grid, block, shared memory, kernel name/PTX and extra
arguments, on symbolic B/L (decode) and B/T/S (prefill), evaluate at two concrete sizes to the int contracts
(`decode_launches`, `prefill_launch`); the PTX compiles for sm_90 at K3 shapes with parameters matching its entry.
Interpreter (TRITON_INTERPRET=1, subprocess): the wrapper kernels, launched with the contracts' grids, scalars and
constants, equal the existing kernels (`kernels.py`, launched with the float scale as an argument) bit for bit in
fp32, and the torch launchers `mla_decode_fwd` / `mla_prefill_fwd` too. GPU (`cuda`, never run yet): the PTX
through the CUDA driver (cupy) against `torch.ops.k3.mla_decode` / `mla_prefill`. TensorRT itself: skipped, not
installable here.

Error = max |a - b| / max |b|.
"""

import json
import math
import os

if __name__ == "__main__":  # the interpreter run (see `interp` in conftest.py): set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

SCALE = 1.0 / math.sqrt(192)
TRT_SKIP = "TensorRT is not installable here (docs/deployment-notes)"
# bf16 plugin launch vs torch.ops.k3.* (GPU): the same fp32 math, but reordered where the launch differs from the
# op's (another num_splits: another split merge; the full prefill block: other tiles), and even with the op's launch
# the scale is a compiled-in constant (ptxas may contract the fp32 multiply differently); then one bf16 rounding of
# o, which may flip by one bf16 ulp. An element in max |o|'s binade [2^e, 2^(e+1)) has an ulp of 2^(e-7), up to
# 2^-7 of max |o| (the H200 showed 1/254 at H=12, B=5, L=1000, 40 splits: one ulp at max |o| ~ 1.98 * 2^e).
BF16_ULP_BOUND = 2.0 ** -7


def _rel(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


# ---------------------------------------------------------------------------------------------- PTX (CPU)
def test_ptx_at_k3_shapes():
    """sm_90 PTX for the three wrappers at K3 (96 heads, R 576, v_dim 512; prefill 12 heads, 192 / 128, bf16);
    parameters = the wrapper's non-constexpr params, pointers / i32 only (no float: TensorRT passes ints)."""
    from k3export.plugins.aot import _entry_params
    from k3export.plugins.mla import trt
    split, comb, inter = trt.decode_launches(1, 96, 65536, 576, 512, torch.bfloat16, SCALE)
    S = trt.decode_splits(1, 96, 65536)
    assert split.scalars["num_splits"] == S and inter["o_part"][0] == (1, 96, S, 512)
    pre = trt.prefill_launch(2, 300, 400, 12, 192, 128, torch.bfloat16, SCALE, block_m=trt.plugin_block_m(
        torch.bfloat16))
    for launch in (split, comb, pre):
        k = launch.kernel
        assert ".target sm_90" in k.ptx and k.name.endswith("_trt_kernel")
        assert len(_entry_params(k.ptx, k.name)) == len(launch.params) + k.hidden_params
        assert {t for _, t in launch.params} <= {"*bf16", "*fp32", "*i64", "i32"}
        assert set(launch.scalars) == {n for n, t in launch.params if t == "i32"}
        assert k.shared_mem <= 227 * 1024
    assert pre.grid == (3, 24, 1) and comb.grid == (96, 1, 4) and split.grid == (3, S, 1)   # 4 x 128 columns


def test_prefill_full_block_equals_torch_launcher_above_64_tokens():
    from k3export.plugins.mla import trt
    full = trt.plugin_block_m(torch.bfloat16)
    for T in (65, 300):
        a = trt.prefill_plan(2, T, T + 7, 12, 192, 128, torch.bfloat16, SCALE)
        b = trt.prefill_plan(2, T, T + 7, 12, 192, 128, torch.bfloat16, SCALE, block_m=full)
        assert a == b
    assert trt.prefill_plan(2, 5, 12, 12, 192, 128, torch.bfloat16, SCALE).constexprs["BLOCK_M"] == 16


def test_bad_num_splits_is_refused():
    from k3export.plugins.mla import trt
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        trt.decode_launches(1, 12, 100, 576, 512, torch.bfloat16, SCALE, num_splits=0)


def test_tensorrt_registration_on_tensorrt():
    pytest.importorskip("tensorrt", reason=TRT_SKIP)
    from k3export.plugins.mla import trt
    assert trt.register_plugins()


# ---------------------------------------------------------------------------------------------- stand-in (CPU)
def test_plugin_registration_against_a_stand_in(monkeypatch):
    """`register_plugins` on the stand-in; descriptors and aot_impl on symbolic B, L (decode) and B, T, S (prefill)
    evaluate at two sizes each to `decode_launches(..., num_splits)` and `prefill_launch(..., full block)`."""
    from trt_standin import Sym, ev, install

    from k3export.plugins.mla import trt
    fake, trtp = install(monkeypatch)
    assert trt.register_plugins()
    assert set(trtp.registered) == set(trtp.aot) == {"k3::mla_decode_split", "k3::mla_decode_combine",
                                                     "k3::mla_prefill"}
    TD, bf, f32, i64 = trtp.TensorDesc, fake.bfloat16, fake.float32, "trt.int64"

    def run(name, ins, **attrs):
        fn, tensors, attr_names, n_out = trtp.registered[name]
        outs = fn(*(ins[t] for t in tensors), **{a: attrs[a] for a in attr_names})
        assert len(outs) == n_out
        res = trtp.aot[name](*(ins[t] for t in tensors), **{a: attrs[a] for a in attr_names}, outputs=outs,
                             tactic=0)
        return outs, res

    def check(res, launch, n):
        name, ptx, params, extra = res
        assert (name, ptx) == (launch.kernel.name, launch.kernel.ptx)
        assert tuple(ev(g, n) for g in (params.grid_x, params.grid_y, params.grid_z)) == launch.grid
        assert (params.block_x, params.shared_mem) == (launch.block[0], launch.kernel.shared_mem)
        assert [ev(v, n) for v in extra] == [launch.scalars[p] for p, t in launch.params if t == "i32"]

    def shape(desc, n):
        return tuple(ev(x, n) for x in desc.shape_expr)

    # decode: 12 heads (one head block of 16), K3's row width, num_splits = the rule's at B = 2, L = 4096
    H, R, V = 12, 576, 512
    S = trt.decode_splits(2, H, 4096)
    B, L = Sym(lambda n: n[0]), Sym(lambda n: n[1])
    dec = dict(q=TD((B, H, R), bf), cache=TD((B, L, R), bf), cache_len=TD((B,), i64), new_row=TD((B, R), bf))
    (o_part, lse_part), res_split = run("k3::mla_decode_split", dec, scale=SCALE, v_dim=V, num_splits=S)
    assert o_part.shape == (-1, H, S, V) and lse_part.shape == (-1, H, S)     # S static: aot reads it back
    dec.update(o_part=o_part, lse_part=lse_part)
    (o,), res_comb = run("k3::mla_decode_combine", dec, scale=SCALE, v_dim=V)
    for n in ((2, 4096), (7, 300)):
        split, comb, inter = trt.decode_launches(n[0], H, n[1], R, V, torch.bfloat16, SCALE, num_splits=S)
        check(res_split, split, n)
        check(res_comb, comb, n)
        assert (shape(o_part, n), o_part.dtype) == (inter["o_part"][0], f32)
        assert (shape(lse_part, n), lse_part.dtype) == (inter["lse_part"][0], f32)
        assert (shape(o, n), o.dtype) == ((n[0], H, V), bf)
    assert trt.decode_launches(2, H, 4096, R, V, torch.bfloat16, SCALE)[0] == \
        trt.decode_launches(2, H, 4096, R, V, torch.bfloat16, SCALE, num_splits=S)[0]    # = the torch op's there

    # prefill: 12 heads, 192 / 128; symbolic B, T, S (S = old rows + T)
    H, D, Dv = 12, 192, 128
    B, T, Sk = Sym(lambda n: n[0]), Sym(lambda n: n[1]), Sym(lambda n: n[2])
    pre = dict(q=TD((B, T, H, D), bf), k=TD((B, Sk, H, D), bf), v=TD((B, Sk, H, Dv), bf), past_len=TD((B,), i64))
    (o,), res = run("k3::mla_prefill", pre, scale=SCALE)
    for n in ((1, 5, 5), (3, 300, 450)):
        launch = trt.prefill_launch(*n, H, D, Dv, torch.bfloat16, SCALE, block_m=trt.plugin_block_m(torch.bfloat16))
        check(res, launch, n)
        assert (shape(o, n), o.dtype) == ((n[0], n[1], H, Dv), bf)


# ---------------------------------------------------------------------------------------------- interpreter
def _launch(plan, tensors, fn=None, **extra):
    """Launch a plan's kernel (or `fn`, the kernel it wraps, given `extra` runtime args) under the interpreter."""
    cx = dict(plan.constexprs)
    if fn is not None:
        extra["qk_scale"] = cx.pop("qk_scale")          # the wrapped kernels take it as a runtime fp32
    (fn or plan.fn)[plan.grid](**{n: tensors[n] for n, t in plan.params if t.startswith("*")}, **plan.scalars,
                               **extra, **cx, num_warps=plan.num_warps, num_stages=plan.num_stages)


def _interpreter_cases() -> dict:
    from k3export.plugins.mla import trt
    from k3export.plugins.mla.kernels import (mla_decode_combine_kernel, mla_decode_fwd, mla_decode_fwd_kernel,
                                              mla_prefill_fwd, mla_prefill_fwd_kernel)
    from k3export.plugins.mla.naive import mla_decode_attention, mla_prefill_attention
    res = {}
    torch.manual_seed(0)
    B, H, R, V, L, S = 2, 5, 40, 32, 50, 3               # R = 32 + 8: value and rope parts, as 576 = 512 + 64
    q, cache, row = torch.randn(B, H, R), torch.randn(B, L, R), torch.randn(B, R)
    cache_len = torch.tensor([50, 7])                     # full, and shorter than the splits (an empty split)
    split = trt.decode_split_plan(B, H, L, R, V, torch.float32, SCALE, S)
    comb = trt.decode_combine_plan(B, H, R, V, torch.float32, SCALE, S)
    runs = {}
    for how in ("wrapper", "kernel"):
        t = dict(q=q, cache=cache, cache_len=cache_len, new_row=row)
        t.update({n: torch.empty(shp, dtype=dt) for n, (shp, dt) in trt.decode_intermediates(B, H, V, S).items()})
        t["o"] = torch.empty(B, H, V)
        _launch(split, t, **({} if how == "wrapper" else dict(fn=mla_decode_fwd_kernel)))
        _launch(comb, t, **({} if how == "wrapper" else dict(fn=mla_decode_combine_kernel)))
        runs[how] = t
    for n in ("o_part", "lse_part", "o"):
        res[f"decode-{n}-bit-equal"] = bool(torch.equal(runs["wrapper"][n], runs["kernel"][n]))
    op = mla_decode_fwd(q, cache, row, cache_len, SCALE, V, num_splits=S)
    res["decode-op-bit-equal"] = bool(torch.equal(runs["wrapper"]["o"], op))
    ref = mla_decode_attention(q.double(), cache.double(), row.double(), cache_len, SCALE, V)
    res["decode-vs-fp64"] = _rel(runs["wrapper"]["o"], ref)

    torch.manual_seed(1)
    B, T, H, D, Dv, Lc = 2, 40, 3, 24, 16, 13             # D = 16 + 8: the split head dim, as 192 = 128 + 64
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, Lc + T, H, D), torch.randn(B, Lc + T, H, Dv)
    past_len = torch.tensor([5, 13])
    plan = trt.prefill_plan(B, T, Lc + T, H, D, Dv, torch.float32, SCALE, trt.plugin_block_m(torch.float32))
    outs = {}
    for how in ("wrapper", "kernel"):
        t = dict(q=q, k=k, v=v, past_len=past_len, o=torch.empty(B, T, H, Dv))
        _launch(plan, t, **({} if how == "wrapper" else dict(fn=mla_prefill_fwd_kernel)))
        outs[how] = t["o"]
    res["prefill-bit-equal"] = bool(torch.equal(outs["wrapper"], outs["kernel"]))
    res["prefill-op-bit-equal"] = bool(torch.equal(outs["wrapper"], mla_prefill_fwd(q, k, v, past_len, SCALE)))
    res["prefill-vs-fp64"] = _rel(outs["wrapper"], mla_prefill_attention(q.double(), k.double(), v.double(),
                                                                          past_len, SCALE))
    # fp16, T = 5 < 128: the plugin's full block (128 rows, 123 of them masked) vs the torch launcher's 16
    q, k, v = q[:, :5].half(), k[:, :Lc + 5].half(), v[:, :Lc + 5].half()
    plan = trt.prefill_plan(B, 5, Lc + 5, H, D, Dv, torch.float16, SCALE, trt.plugin_block_m(torch.float16))
    t = dict(q=q, k=k, v=v, past_len=past_len, o=torch.empty(B, 5, H, Dv, dtype=torch.float16))
    _launch(plan, t)
    res["prefill-fp16-full-block-vs-op"] = _rel(t["o"], mla_prefill_fwd(q, k, v, past_len, SCALE))
    return res


@pytest.mark.parametrize("case", ["decode-o_part", "decode-lse_part", "decode-o", "decode-op", "prefill",
                                  "prefill-op"])
def test_interpreted_wrappers_bit_equal(interp, case):
    """fp32, tiny shapes: the wrapper (scale compiled in) == the wrapped kernel (scale as an fp32 argument) and ==
    the torch launcher (same num_splits; prefill in fp32 uses block 32 in both)."""
    assert interp[f"{case}-bit-equal"], interp


def test_interpreted_prefill_full_block_small_t(interp):
    """The plugin's full 128-row block at T = 5 (rows >= T masked) gives the torch launcher's 16-row result (with
    old rows; the interpreter's fp16 dots are per row, so equal here; a GPU may retile: see the cuda test)."""
    assert interp["prefill-fp16-full-block-vs-op"] == 0.0, interp


@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_interpreted_wrappers_vs_fp64(interp, case):
    assert interp[f"{case}-vs-fp64"] < 1e-5, interp          # tests/test_mla_kernels.py's FP32_BOUND


# ---------------------------------------------------------------------------------------------- GPU (never run yet)
@pytest.mark.cuda
@pytest.mark.parametrize("H,B,L,splits", [(96, 1, 4096, None), (96, 1, 65536, 8), (12, 5, 1000, 40)])
def test_decode_plugin_launch_through_cupy(H, B, L, splits):
    """The plugins' launches (split, combine) through the CUDA driver vs torch.ops.k3.mla_decode, with the op's
    split count (None) and with others."""
    pytest.importorskip("cupy", reason="cupy launches the PTX through the CUDA driver")
    from k3export.plugins.aot import launch_cupy
    from k3export.plugins.mla import trt
    torch.manual_seed(6)
    q, cache, row = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((B, H, 576), (B, L, 576),
                                                                                      (B, 576)))
    cache_len = torch.randint(0, L + 1, (B,), device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split, comb, inter = trt.decode_launches(B, H, L, 576, 512, torch.bfloat16, SCALE, sms=sms, num_splits=splits)
    t = {n: torch.empty(*shape, device="cuda", dtype=dt) for n, (shape, dt) in inter.items()}
    o = torch.empty(B, H, 512, device="cuda", dtype=torch.bfloat16)
    launch_cupy(split, dict(q=q, cache=cache, cache_len=cache_len, **t))
    launch_cupy(comb, dict(q=q, new_row=row, o=o, **t))
    ref = torch.ops.k3.mla_decode(q, cache, row, cache_len, SCALE, 512)
    assert _rel(o, ref) <= BF16_ULP_BOUND, _rel(o, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [5, 300])
def test_prefill_plugin_launch_through_cupy(T):
    """The plugin's launch (full block) vs torch.ops.k3.mla_prefill (block min(128, pow2(T)))."""
    pytest.importorskip("cupy", reason="cupy launches the PTX through the CUDA driver")
    from k3export.plugins.aot import launch_cupy
    from k3export.plugins.mla import trt
    torch.manual_seed(7)
    B, Lc, H = 2, 100, 12
    q = torch.randn(B, T, H, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Lc + T, H, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Lc + T, H, 128, device="cuda", dtype=torch.bfloat16)
    past_len = torch.tensor([100, 40], device="cuda")
    o = torch.empty(B, T, H, 128, device="cuda", dtype=torch.bfloat16)
    launch = trt.prefill_launch(B, T, Lc + T, H, 192, 128, torch.bfloat16, SCALE,
                                block_m=trt.plugin_block_m(torch.bfloat16))
    launch_cupy(launch, dict(q=q, k=k, v=v, past_len=past_len, o=o))
    ref = torch.ops.k3.mla_prefill(q, k, v, past_len, SCALE)
    assert _rel(o, ref) <= BF16_ULP_BOUND, _rel(o, ref)


if __name__ == "__main__":
    print(json.dumps(_interpreter_cases()))
