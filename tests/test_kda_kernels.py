"""KDA Triton kernels vs the plain-torch references (plugins/kda/naive.py), on fresh random inputs.

CPU: the kernels run under Triton's interpreter at tiny shapes (fp32 and fp16: the interpreter has no bf16).
GPU (`cuda`): K3 shapes (H = 96 and the TP-8 shard H = 12, K = V = 128, T up to 32k, mixed lengths), fla-core's
own `naive_recurrent_kda`, and the AOT launch contracts run through cupy.
Errors are relative RMS, `rms(x - ref) / rms(ref)`, per output; each bound is named with its reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from k3export.plugins.kda import kernels
from k3export.plugins.kda.naive import kda_inputs, naive_recurrent_kda
from k3export.plugins.kda.op import kda_decode, kda_decode_inplace, kda_prefill

# fp32 everywhere: the reference itself is ~3.6e-7 from fp64 (CONTRACT.md); measured kernel error ~2e-7.
FP32_BOUND = 1e-5
# fp16 inputs: W, U, exp(Gam) q, decayed k, A_qk are stored and multiplied in fp16 (11-bit mantissa), the state
# operand of the chunk matmuls too; measured 4e-4 (interpreter, T=150).
FP16_PREFILL_BOUND = 3e-3
# bf16 on the H200: the same intermediates in bf16 (8-bit mantissa, 8x coarser than fp16) plus tf32 in the
# UT transform; o is also rounded to bf16 (rel. 2^-9 = 2e-3 alone).
BF16_PREFILL_BOUND = 2e-2
BF16_STATE_BOUND = 2e-2
# Decode follows the op's own roundings step by step; what is left is fp32 summation order (state) and
# occasional 1-ulp flips of o rounded to 16 bits (one flip among the >= 12288 outputs of the GPU cases is
# ~2^-8 / sqrt(12288) = 3.5e-5 rel. RMS in bf16). Measured o: bf16 on the H200 <= 5.6e-5 (plugins/kda/CONTRACT.md);
# fp16 in the interpreter <= 3.9e-5 over 12 draws (B,H,K = 3,2,16 and 2,3,32); fp32 <= 2e-7. Bounds ~10-20x that.
DECODE_STATE_BOUND = 1e-5
DECODE_O_BOUND = {torch.float32: 1e-5, torch.float16: 5e-4, torch.bfloat16: 1e-3}


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def prefill_inputs(B, T, H, K, V, dtype, device, lengths, decay_shift=0.0, seed=0):
    """Random op inputs. decay_shift > 0 pushes gates towards the -5 bound (strong decay, the sub-tile edge case)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    q, k, f = (r(B, T, H, K).to(device, dtype) for _ in range(3))
    v = r(B, T, H, V).to(device, dtype)
    b = r(B, T, H).to(device, dtype)
    A_log = (r(H) * 0.5).to(device)
    dt_bias = (r(H * K) + decay_shift).to(device)
    S0 = r(B, H, K, V).to(device)
    return q, k, v, f, b, A_log, dt_bias, S0, torch.tensor(lengths, device=device)


def decode_inputs(B, H, K, dtype, device, W=4, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    C = 3 * H * K
    return (r(B, C).to(device, dtype), r(B, C, W - 1).to(device, dtype), (r(C, W) * 0.5).to(device, dtype),
            r(B, H * K).to(device, dtype), r(B, H).to(device, dtype), r(B, H * K).to(device, dtype),
            (r(H) * 0.5).to(device), r(H * K).to(device), (torch.rand(K, generator=g) + 0.5).to(device, dtype),
            r(B, H, K, K).to(device))


def check_prefill(args, o_bound, s_bound, o, S):
    o_ref, S_ref = kda_prefill._init_fn(*args, -5.0)          # the reference (chunked, fp32)
    lengths = args[-1]
    for i, n in enumerate(lengths.tolist()):
        assert torch.isfinite(o[i]).all(), f"sequence {i}: non-finite output (padding rows must stay finite)"
        if n:
            err = rel(o[i, :n], o_ref[i, :n])
            assert err < o_bound, f"sequence {i} (length {n}): o rel. RMS {err:.2e} >= {o_bound:.0e}"
    err = rel(S, S_ref)
    assert err < s_bound, f"final state rel. RMS {err:.2e} >= {s_bound:.0e}"
    assert o.dtype == args[0].dtype and S.dtype == args[7].dtype
    return err


# --- CPU: Triton interpreter ------------------------------------------------------------------------------------

# TRITON_INTERPRET is read when `@triton.jit` decorates (at import, also for Triton's own library functions),
# so the interpreter tests run in a child pytest started with it set; here they skip and the driver checks them.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 child of "
                                                       "test_interpreter_suite")


def test_interpreter_suite():
    if INTERPRET:
        pytest.skip("this is the interpreter child")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "interpreter"], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                       timeout=600)
    report = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 0, report
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 5, report


# Prefill launch configurations (kernels.prefill_config overrides): the default, and the state pass with V in two
# blocks of 16 (at K3's V = 128 the default BV 64 is two blocks too).
# "split": the intra work in two launches (kernels.INTRA_CONFIGS["split"]: gate and A_kk/A_qk, then UT and W/U);
PREFILL_VARIANTS = {"default": {}, "two-V-blocks": dict(BV=16), "split": dict(intra="split")}


@interpreted
@pytest.mark.parametrize("variant", list(PREFILL_VARIANTS))
@pytest.mark.parametrize("dtype,K,V,bound", [(torch.float32, 16, 32, FP32_BOUND),
                                             (torch.float16, 32, 32, FP16_PREFILL_BOUND)])
def test_prefill_interpreter(dtype, K, V, bound, variant):
    # 3 chunks (the last partial), lengths: full, mid-chunk, empty; strong decay so Gam spans > e^88 per chunk.
    args = prefill_inputs(3, 150, 2, K, V, dtype, "cpu", [150, 97, 0], decay_shift=3.0)
    o, S = kernels.kda_prefill_fwd(*args, -5.0, config=PREFILL_VARIANTS[variant])
    check_prefill(args, bound, bound, o, S)
    assert torch.equal(S[2], args[7][2]), "a length-0 sequence must leave its state untouched"


@interpreted
def test_prefill_interpreter_vs_recurrence():
    """Against the token-by-token ground truth directly (not only the chunked reference)."""
    q, k, v, f, b, A_log, dt_bias, S0, lengths = prefill_inputs(1, 130, 2, 16, 16, torch.float32, "cpu", [130])
    o, S = kernels.kda_prefill_fwd(q, k, v, f, b, A_log, dt_bias, S0, lengths, -5.0)
    qn, kn, g, beta = kda_inputs(q, k, f, b, A_log, dt_bias, -5.0)
    o_ref, S_ref = naive_recurrent_kda(qn, kn, v, g, beta, S0)
    assert rel(o, o_ref) < FP32_BOUND and rel(S, S_ref) < FP32_BOUND


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_interpreter(dtype):
    args = decode_inputs(3, 2, 32, dtype, "cpu")
    out = kernels.kda_decode_fwd(*args, -5.0, 1e-5)
    ref = kda_decode._init_fn(*args, -5.0, 1e-5)
    assert rel(out[0], ref[0]) < DECODE_O_BOUND[dtype]
    assert torch.equal(out[1], ref[1]), "the conv window shift is exact"
    assert rel(out[2], ref[2]) < DECODE_STATE_BOUND
    assert [t.dtype for t in out] == [t.dtype for t in ref]


def inplace_inputs(B, H, K, R, dtype, device, seed=0):
    """decode_inputs plus f_a `[B, R]` and f_b_weight `[H*K, R]` (scaled so f has unit size), and the
    decode_inputs-style f they imply (f_b_proj's output, rounded to the model dtype)."""
    args = list(decode_inputs(B, H, K, dtype, device, seed=seed))
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    f_a = torch.randn(B, R, generator=g).to(device, dtype)
    w = (torch.randn(H * K, R, generator=g) * R ** -0.5).to(device, dtype)
    return args, f_a, w


def check_inplace(args, f_a, w, run, o_bound):
    """run(qkv, conv, conv_weight, f, f_b_weight, b, g, A_log, dt_bias, o_norm_weight, state) updates conv and
    state in place and returns o; compared with the pure op's reference on f = f_b_proj(f_a), with and without
    the fold. Returns the largest o error."""
    errs = []
    for fold in (True, False):
        qkv, conv, cw, _, b, g, A_log, dt_bias, onw, state = (t.clone() for t in args)
        f = torch.nn.functional.linear(f_a, w)
        o_ref, conv_ref, state_ref = kda_decode._init_fn(qkv, conv, cw, f, b, g, A_log, dt_bias, onw, state,
                                                         -5.0, 1e-5)
        o = run(qkv, conv, cw, f_a if fold else f, w if fold else None, b, g, A_log, dt_bias, onw, state)
        errs.append(rel(o, o_ref))
        assert errs[-1] < o_bound, f"fold={fold}: o rel. RMS {errs[-1]:.2e}"
        assert torch.equal(conv, conv_ref), "the conv window shift is exact, in place too"
        assert rel(state, state_ref) < DECODE_STATE_BOUND
        assert o.dtype == qkv.dtype
    return max(errs)


def test_decode_inplace_reference_updates_its_arguments():
    """The op's default implementation (CPU): the pure op's results, written over conv_state and state."""
    args, f_a, w = inplace_inputs(2, 3, 16, 16, torch.float32, "cpu")
    check_inplace(args, f_a, w, lambda *a: kda_decode_inplace(*a, -5.0, 1e-5), 1e-6)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_inplace_interpreter(dtype):
    """The in-place kernel with the f_b_proj GEMV folded in (R = 24: a partial 32-column block) and without;
    fp16: f is rounded to fp16 as the Linear's output is, the sum order differs (bound as the pure decode's)."""
    args, f_a, w = inplace_inputs(3, 2, 32, 24, dtype, "cpu", seed=4)
    check_inplace(args, f_a, w, lambda *a: kernels.kda_decode_inplace_fwd(*a, -5.0, 1e-5), DECODE_O_BOUND[dtype])


@interpreted
def test_decode_inplace_interpreter_strided_state_falls_back():
    """A state that cannot be written in place (non-contiguous) still gets the step: out-of-place kernel + copy."""
    args, f_a, w = inplace_inputs(2, 2, 16, 16, torch.float32, "cpu", seed=5)
    big = torch.randn(2, 2, 16, 32)

    def run(qkv, conv, cw, f, fw, b, g, A_log, dt_bias, onw, state):
        view = big[..., :16]                                          # [B, H, K, K], strided
        view.copy_(state)
        o = kernels.kda_decode_inplace_fwd(qkv, conv, cw, f, fw, b, g, A_log, dt_bias, onw, view, -5.0, 1e-5)
        state.copy_(view)
        return o
    check_inplace(args, f_a, w, run, DECODE_O_BOUND[torch.float32])


def test_bad_inputs_have_specific_errors():
    args = list(prefill_inputs(2, 8, 2, 16, 16, torch.float32, "cpu", [8, 8]))
    bad = list(args)
    bad[1] = bad[1][:, :4]
    with pytest.raises(ValueError, match="k must have shape"):
        kernels.kda_prefill_fwd(*bad, -5.0)
    with pytest.raises(ValueError, match="lower_bound"):
        kernels.kda_prefill_fwd(*args, -8.0)
    dargs = list(decode_inputs(2, 2, 16, torch.float32, "cpu"))
    dargs[9] = dargs[9][:, :, :8]
    with pytest.raises(ValueError, match="state must have shape"):
        kernels.kda_decode_fwd(*dargs, -5.0, 1e-5)
    iargs, f_a, w = inplace_inputs(2, 2, 16, 16, torch.float32, "cpu")
    qkv, conv, cw, _, b, g, A_log, dt_bias, onw, state = iargs
    with pytest.raises(ValueError, match="f_b_weight"):
        kernels.kda_decode_inplace_fwd(qkv, conv, cw, f_a, w[:, :8], b, g, A_log, dt_bias, onw, state, -5.0, 1e-5)


def test_aot_decode_contract_compiles_on_cpu():
    """The contract is plain data: PTX for sm_90 compiles without a GPU; params are inputs, scalars, outputs."""
    from k3export.plugins.kda import trt

    launch = trt.decode_launch(B=5, H=2, K=16, W=4, dtype=torch.bfloat16)
    names = [n for n, _ in launch.params]
    assert names[:10] == ["qkv", "conv_state", "conv_weight", "f", "b", "g", "A_log", "dt_bias", "o_norm_weight",
                          "state"] and names[10:] == ["o", "conv_out", "state_out"]
    assert launch.grid == (10, 1, 1) and launch.block[0] == 32 * kernels.decode_config(16, 4)["num_warps"]
    assert f".entry {launch.kernel.name}(" in launch.kernel.ptx and ".target sm_90" in launch.kernel.ptx
    k3 = trt.decode_launch(B=1, H=96, K=128, W=4, dtype=torch.bfloat16)      # K3: the register cap travels in the PTX
    assert ".maxnreg 168" in k3.kernel.ptx and ".maxnreg" not in launch.kernel.ptx


def test_default_split_kernels_compile_for_sm90_on_cpu():
    """The default split intra launches as the GPU runs them compile to sm_90 PTX here: FAST_MATH (libdevice's
    approximate division in the gate) cannot run under the interpreter, whose tests take the tl.sigmoid path, so
    this is the CPU suite's only check of that path; its numerics are checked by the cuda tests."""
    from k3export.plugins.aot import compile_ptx

    cfg = kernels.prefill_config(128, 128)
    ptr = {"q": "*bf16", "k": "*bf16", "f": "*bf16", "b": "*bf16", "A_log": "*fp32", "dt_bias": "*fp32",
           "lengths": "*i64", "T": "i32", "w": "*bf16", "qg": "*bf16", "kd": "*bf16", "aqk": "*bf16", "gl": "*fp32",
           "akk": "*fp32"}
    cx = dict(H=96, K=128, BK=128, BT=64, BC=kernels.BC, LOWER=-5.0, PREC="tf32", LOW=True, FAST_MATH=True)
    akk = compile_ptx(kernels.kda_prefill_akk_fwd_kernel, {**ptr, **{n: "constexpr" for n in cx}}, cx,
                      num_warps=cfg["intra_warps"])
    assert ".target sm_90" in akk.ptx and "div.approx" in akk.ptx       # the gate's fast division is in
    wu_ptr = {"v": "*bf16", "b": "*bf16", "lengths": "*i64", "T": "i32", "akk": "*fp32", "w": "*bf16", "u": "*bf16"}
    wcx = dict(H=96, K=128, V=128, BK=128, BV=128, BT=64, BC=kernels.BC, PREC="tf32", LOW=True)
    wu = compile_ptx(kernels.kda_prefill_wu_fwd_kernel, {**wu_ptr, **{n: "constexpr" for n in wcx}}, wcx,
                     num_warps=cfg["wu_warps"], maxnreg=cfg["wu_maxnreg"])
    assert ".maxnreg 168" in wu.ptx


def test_intra_variant_by_env(monkeypatch):
    """K3_KDA_INTRA=<name of kernels.INTRA_CONFIGS> selects the intra launch(es) of the op (scripts/gpu_kda.sh runs
    the cuda tests that way); the AOT contract keeps the one-launch kernel (a plugin is one launch, no workspace);
    an unknown name is an error naming the known ones."""
    from k3export.plugins.kda import trt

    monkeypatch.setenv("K3_KDA_INTRA", "split-wu4r168")
    cfg = kernels.prefill_config(128, 128)
    assert (cfg["intra"], cfg["intra_warps"], cfg["wu_warps"]) == ("split", 8, 4)
    intra, _ = trt.prefill_launches(1, 64, 2, 128, 128, torch.bfloat16)
    assert intra.kernel.name.startswith("kda_prefill_intra_fwd_kernel") and intra.block[0] == 32 * 8
    monkeypatch.setenv("K3_KDA_INTRA", "nope")
    with pytest.raises(ValueError, match="unknown intra variant.*split"):
        kernels.prefill_config(128, 128)
    monkeypatch.delenv("K3_KDA_INTRA")
    cfg = kernels.prefill_config(128, 128)                  # the default at K3's head dims: split, measured fastest
    assert (cfg["intra"], cfg["intra_warps"], cfg["wu_warps"], cfg["wu_maxnreg"]) == ("split", 4, 4, 168)
    assert kernels.prefill_config(16, 16)["intra"] == "full"


def test_tensorrt_plugins():
    pytest.importorskip("tensorrt", reason="TensorRT cannot be installed on these machines "
                                           "(see docs/deployment-notes); the AOT contracts are tested via cupy")
    from k3export.plugins.kda import trt
    assert trt.register_plugins()


def test_plugin_registration_against_a_stand_in(monkeypatch):
    """`register_plugins` on a stand-in of `tensorrt.plugin` that makes its registration checks (tests/
    trt_standin.py), then each plugin's descriptor and aot_impl on symbolic B and T: output shapes, grid, block,
    shared memory, PTX and the T scalar evaluate to the int contracts (`decode_launch`, `prefill_launches`)."""
    from trt_standin import Sym, ev, install

    from k3export.plugins.kda import trt
    fake, trtp = install(monkeypatch)
    assert trt.register_plugins()
    assert set(trtp.registered) == set(trtp.aot) == {"k3::kda_decode", "k3::kda_prefill_intra",
                                                     "k3::kda_prefill_chunks"}
    H, K, W = 2, 128, 4
    B, T = Sym(lambda n: n[0]), Sym(lambda n: n[1])
    TD, bf, f32 = trtp.TensorDesc, fake.bfloat16, fake.float32

    def run(name, ins, **attrs):
        fn, tensors, attr_names, n_out = trtp.registered[name]
        outs = fn(*(ins[t] for t in tensors), **{a: attrs[a] for a in attr_names})
        assert len(outs) == n_out
        res = trtp.aot[name](*(ins[t] for t in tensors), **{a: attrs[a] for a in attr_names}, outputs=outs, tactic=0)
        return outs, res

    def check(res, launch, grid_at, scalars, n):
        name, ptx, params, extra = res
        assert (name, ptx) == (launch.kernel.name, launch.kernel.ptx)
        assert tuple(ev(g, n) for g in (params.grid_x, params.grid_y, params.grid_z)) == grid_at
        assert (params.block_x, params.shared_mem) == (launch.block[0], launch.kernel.shared_mem)
        assert [ev(v, n) for v in extra] == scalars

    dec = dict(qkv=TD((B, 3 * H * K), bf), conv_state=TD((B, 3 * H * K, W - 1), bf), conv_weight=TD((3 * H * K, W), bf),
               f=TD((B, H * K), bf), b=TD((B, H), bf), g=TD((B, H * K), bf), A_log=TD((H,), f32),
               dt_bias=TD((H * K,), f32), o_norm_weight=TD((K,), bf), state=TD((B, H, K, K), f32))
    outs, res = run("k3::kda_decode", dec, lower_bound=-5.0, eps=1e-5)
    for n in ((1, 0), (7, 0)):
        launch = trt.decode_launch(n[0], H, K, W, torch.bfloat16, -5.0, 1e-5)
        check(res, launch, launch.grid, [], n)
        assert [tuple(ev(x, n) for x in o.shape_expr) for o in outs] == [(n[0], H * K), (n[0], 3 * H * K, W - 1),
                                                                         (n[0], H, K, K)]
    pre = dict(q=TD((B, T, H, K), bf), k=TD((B, T, H, K), bf), v=TD((B, T, H, K), bf), f=TD((B, T, H, K), bf),
               b=TD((B, T, H), bf), A_log=TD((H,), f32), dt_bias=TD((H * K,), f32), lengths=TD((B,), fake.int32))
    inter, res_intra = run("k3::kda_prefill_intra", pre, lower_bound=-5.0)
    pre.update(zip(("w", "u", "qg", "kd", "aqk", "gl"), inter), initial_state=TD((B, H, K, K), f32))
    (o, ht), res_chunks = run("k3::kda_prefill_chunks", pre)
    for n in ((1, 64), (3, 200)):
        intra, chunk = trt.prefill_launches(n[0], n[1], H, K, K, torch.bfloat16, -5.0)
        g_intra, g_chunk = trt.prefill_grids(n[0], n[1], H, K, K)
        NT64 = -(-n[1] // 64) * 64
        check(res_intra, intra, g_intra, [n[1]], n)
        check(res_chunks, chunk, g_chunk, [NT64], n)          # the chunk plugin runs on the padded length
        want = {k_: s_ for k_, (s_, _) in trt.prefill_intermediates(n[0], n[1], H, K, K, torch.bfloat16).items()}
        assert [tuple(ev(x, n) for x in d.shape_expr) for d in inter] == list(want.values())
        assert tuple(ev(x, n) for x in o.shape_expr) == (n[0], NT64, H, K)


# --- GPU: K3 shapes ---------------------------------------------------------------------------------------------

PREFILL_CASES = [  # (B, T, H, lengths)
    (1, 8192, 96, [8192]),
    (3, 3000, 96, [3000, 1717, 1]),
    (1, 32768, 12, [32768]),
    (2, 32768, 12, [32768, 20001]),
]


@pytest.mark.cuda
@pytest.mark.parametrize("B,T,H,lengths", PREFILL_CASES)
def test_prefill_k3_shapes(B, T, H, lengths):
    args = prefill_inputs(B, T, H, 128, 128, torch.bfloat16, "cuda", lengths)
    o, S = kda_prefill(*args, -5.0)                              # dispatches to the Triton kernels
    err = check_prefill(args, BF16_PREFILL_BOUND, BF16_STATE_BOUND, o, S)
    print(f"prefill B={B} T={T} H={H}: state rel {err:.2e}")


@pytest.mark.cuda
def test_prefill_strong_decay_gpu():
    args = prefill_inputs(2, 1000, 12, 128, 128, torch.bfloat16, "cuda", [1000, 333], decay_shift=4.0)
    check_prefill(args, BF16_PREFILL_BOUND, BF16_STATE_BOUND, *kda_prefill(*args, -5.0))


@pytest.mark.cuda
def test_prefill_vs_fla_naive_recurrent():
    """fla-core's own token-by-token reference with its lower-bound gate, on the kernel's inputs."""
    pytest.importorskip("einops", reason="fla's naive module imports einops, absent here")
    fla_naive = pytest.importorskip("fla.ops.kda.naive", reason="fla-core not installed (scripts/gpu.sh installs it)")
    from fla.ops.kda.gate import naive_kda_lowerbound_gate

    B, T, H, K = 2, 384, 12, 128
    q, k, v, f, b, A_log, dt_bias, S0, lengths = prefill_inputs(B, T, H, K, K, torch.bfloat16, "cuda", [T, T])
    o, S = kda_prefill(q, k, v, f, b, A_log, dt_bias, S0, lengths, -5.0)
    l2 = lambda x: x.float() / torch.sqrt(x.float().pow(2).sum(-1, keepdim=True) + 1e-6)
    g = naive_kda_lowerbound_gate(f, A_log, dt_bias, lower_bound=-5.0)
    o_ref, S_ref = fla_naive.naive_recurrent_kda(l2(q), l2(k), v.float(), g, torch.sigmoid(b.float()),
                                                 scale=K ** -0.5, initial_state=S0, output_final_state=True)
    assert rel(o, o_ref) < BF16_PREFILL_BOUND and rel(S, S_ref) < BF16_STATE_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("B,H,cfg", [(1, 96, None), (7, 96, None), (64, 12, None),      # the op, its default
                                     (7, 96, dict(maxnreg=None))],
                         ids=["op-1-96", "op-7-96", "op-64-12", "uncapped"])
def test_decode_k3_shapes(B, H, cfg):
    args = decode_inputs(B, H, 128, torch.bfloat16, "cuda")
    out = (kda_decode(*args, -5.0, 1e-5) if cfg is None             # dispatches to the Triton kernel
           else kernels.kda_decode_fwd(*args, -5.0, 1e-5, config=cfg))
    ref = kda_decode._init_fn(*args, -5.0, 1e-5)
    assert rel(out[0], ref[0]) < DECODE_O_BOUND[torch.bfloat16]
    assert torch.equal(out[1], ref[1])
    assert rel(out[2], ref[2]) < DECODE_STATE_BOUND


@pytest.mark.cuda
@pytest.mark.parametrize("B,H", [(1, 16), (64, 16), (3, 96)])
def test_decode_inplace_cuda(B, H):
    """The serving op on its kernel at k3-small (H = 16) and K3 (H = 96) heads, f_b_proj folded (R = K = 128) and
    not; state and conv window written over the inputs."""
    args, f_a, w = inplace_inputs(B, H, 128, 128, torch.bfloat16, "cuda", seed=B)
    err = check_inplace(args, f_a, w, lambda *a: kda_decode_inplace(*a, -5.0, 1e-5),
                        DECODE_O_BOUND[torch.bfloat16])
    print(f"kda_decode_inplace B={B} H={H}: o rel. RMS {err:.2e}")


@pytest.mark.cuda
def test_aot_contracts_through_cupy():
    """Launch the contract's PTX with the contract's grid/block/smem/params via the CUDA driver: same as the op."""
    pytest.importorskip("cupy", reason="cupy is needed to launch PTX through the driver")
    from k3export.plugins.aot import launch_cupy
    from k3export.plugins.kda import trt

    B, T, H, K = 2, 300, 12, 128
    q, k, v, f, b, A_log, dt_bias, S0, lengths = prefill_inputs(B, T, H, K, K, torch.bfloat16, "cuda", [300, 170])
    intra, chunk = trt.prefill_launches(B, T, H, K, K, torch.bfloat16)
    bufs = {n: torch.empty(s, dtype=dt, device="cuda") for n, (s, dt) in
            trt.prefill_intermediates(B, T, H, K, K, torch.bfloat16).items()}
    o = torch.empty_like(v)
    ht = torch.empty_like(S0)
    launch_cupy(intra, dict(q=q, k=k, v=v, f=f, b=b, A_log=A_log, dt_bias=dt_bias, lengths=lengths, **bufs))
    launch_cupy(chunk, dict(h0=S0, lengths=lengths, o=o, ht=ht, **bufs))
    # The contract's intra launch is the one-launch kernel whatever K3_KDA_INTRA selects for the op (the split
    # variant is two launches with a scratch buffer): compare with that kernel launched by torch.
    o_op, S_op = kernels.kda_prefill_fwd(q, k, v, f, b, A_log, dt_bias, S0, lengths, -5.0,
                                         config=kernels.INTRA_CONFIGS["full"])
    for i, n in enumerate(lengths.tolist()):
        assert rel(o[i, :n], o_op[i, :n]) < 1e-6, "same kernel source: only the specialisation differs"
    assert rel(ht, S_op) < 1e-6

    args = decode_inputs(B, H, K, torch.bfloat16, "cuda")
    launch = trt.decode_launch(B, H, K, 4, torch.bfloat16)
    outs = dict(o=torch.empty_like(args[5]), conv_out=torch.empty_like(args[1]), state_out=torch.empty_like(args[9]))
    names = ["qkv", "conv_state", "conv_weight", "f", "b", "g", "A_log", "dt_bias", "o_norm_weight", "state"]
    launch_cupy(launch, {**dict(zip(names, args)), **outs})
    ref = kda_decode(*args, -5.0, 1e-5)
    assert rel(outs["o"], ref[0]) < 1e-6 and torch.equal(outs["conv_out"], ref[1])
    assert rel(outs["state_out"], ref[2]) < 1e-6
