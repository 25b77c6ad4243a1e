"""Programmatic dependent launch (PDL) of the decode-path Triton kernels (plugins/launch.py: `pdl`, `pdl_args`,
`pdl_wait`): off by default in the launchers, on in the `compile` backend for sm_90+ CUDA models.

CPU: the switch gives no launch options off / on CPU / traced / under the interpreter / below sm_90; with the
`PDL` constexpr the sm_90 PTX of one kernel per file (AttnRes, KDA decode in place, MLA decode) gains exactly
`griddepcontrol.wait` + `griddepcontrol.launch_dependents` before its first memory access and is otherwise the
same instructions; the `compile` backend (PDL on by default for sm_90+ CUDA models) runs its calls inside the
switch.
GPU (`cuda`): a CUDA graph of a chain of dependent kernel launches (in-place KDA state included) replays to the
same bits with PDL as without; k3-small through the `compile` backend with CUDA-graph decode gives the same greedy
tokens and logits with PDL as without (`compile` vs `compile-nopdl` at B = 4 and at B = 1, where the GEMVs run
`k3::gemv` with their early weight loads, and `compile-moepdl` with the MoE decode kernels on PDL),
over several replays, and the PDL kernels were really compiled and launched with it."""

from __future__ import annotations

import re

import pytest
import torch

from k3export.plugins import launch as L

GDC = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")
EARLY = L.EARLY


# ---------------------------------------------------------------------------------------------- the switch
class _CudaLike:
    """Only what `pdl_args` reads of a tensor: its device."""

    def __init__(self, index: int):
        self.device = torch.device("cuda", index)


def test_pdl_args_only_with_the_switch_on_sm90_eager(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(L, "_pdl_capable", {0: True, 1: False})         # device 0 sm_90, device 1 sm_80
    on = {"PDL": True, "launch_pdl": True}
    with L.pdl(False):
        assert L.pdl_args(_CudaLike(0)) == {}
    with L.pdl(True, moe=False):
        assert L.pdl_args(_CudaLike(0)) == on
        assert L.pdl_args(_CudaLike(0), moe=True) == {}                # the MoE kernels: their own switch too
        with L.pdl(True, moe=True):
            assert L.pdl_args(_CudaLike(0), moe=True) == on
        assert L.pdl_args(_CudaLike(0), moe=True) == {}                # restored
        assert L.pdl_args(_CudaLike(1)) == {}                          # below sm_90: plain launch
        assert L.pdl_args(torch.zeros(1)) == {}                        # CPU
        with L.traced_launches():
            assert L.pdl_args(_CudaLike(0)) == {}                      # wrap_triton launches (AOTI) stay plain
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert L.pdl_args(_CudaLike(0)) == {}
    assert L._pdl is (L.os.environ.get("K3_PDL", "0") == "1")          # restored to the env's setting
    assert L._pdl_moe is (L.os.environ.get("K3_MOE_PDL", "0") == "1")


# ---------------------------------------------------------------------------------------------- sm_90 PTX
def _instructions(ptx: str) -> list[str]:
    """The PTX's statements without debug line info, comments and the debug sections."""
    out = []
    for line in ptx.split(".section")[0].splitlines():
        t = line.split("//")[0].strip()
        if t and not t.startswith((".loc", ".file")):
            out.append(t)
    return out


def _kernels():
    from k3export.plugins.attn_res import kernels as ar
    from k3export.plugins.kda import kernels as kda
    from k3export.plugins.mla import kernels as mla
    from k3export.plugins.moe import kernels as moe
    # (kernel, pointer types (others i32 scalars; eps-like fp32), constexprs, num_warps, num_stages)
    return {
        "attn_res": (ar.attn_res_fwd_kernel, dict(eps="fp32", out_eps="fp32"),
                     dict(N_SRC=4, BLOCK_D=256, NORM=True, ADD=True, ONE=True), 4, 1,
                     ("n", "D", "stride_bn", "stride_bj", "stride_pn")),
        "kda_inplace": (kda.kda_decode_inplace_fwd_kernel, dict(A_log="*fp32", dt_bias="*fp32", state="*fp32"),
                        dict(H=2, K=32, R=32, W=4, BK=32, BR=32, BW=4, LOWER=-5.0, EPS=1e-5, FOLD=True), 4, 1, ()),
        "mla_decode": (mla.mla_decode_fwd_kernel, dict(cache_len="*i32", o_part="*fp32", lse_part="*fp32",
                                                       qk_scale="fp32"),
                       dict(BLOCK_H=16, BLOCK_N=32, BLOCK_V=64, BLOCK_PE=16, DOT_PREC="tf32"), 4, 2,
                       ("stride_qb", "stride_qh", "stride_cb", "stride_cl", "H", "num_splits", "V_DIM", "R")),
        "moe_router": (moe.moe_router_fwd_kernel, dict(s="*fp32"),
                       dict(BLOCK_M=16, BLOCK_E=16, BLOCK_D=128, SIGMOID=False, DOT_PREC="ieee", DESC=False), 4, 3,
                       ("N", "E", "D", "stride_xn", "stride_ge", "D_SPLIT")),
        "moe_topk": (moe.moe_topk_fwd_kernel, dict(s="*fp32", part="*fp32", bias="*fp32", ids="*i32", w="*fp32",
                                                   scaling="fp32"),
                     dict(K=8, BLOCK_K=8, BLOCK_E=64, RENORM=True, SPLITS=8, PACKED=True), 4, 1, ("N", "E")),
        "moe_pair_gemm1": (moe.moe_pair_gemm1_fwd_kernel, dict(ids="*i32", beta="fp32", linear_beta="fp32"),
                           dict(TOP_K=8, BLOCK_N=8, BLOCK_K=256), 4, 1,
                           ("L", "I", "stride_zn", "stride_we", "stride_wi", "stride_h")),
        "moe_pair_gemm2_combine": (moe.moe_pair_gemm2_combine_fwd_kernel,
                                   dict(ids="*i32", wt="*fp32", y="*fp32", tickets="*i32"),
                                   dict(TOP_K=8, BLOCK_N=8, BLOCK_K=256), 4, 1,
                                   ("L", "I", "stride_h", "stride_we", "stride_wl", "stride_y", "stride_u")),
    }


@pytest.mark.parametrize("name", ["attn_res", "kda_inplace", "mla_decode", "moe_router", "moe_topk", "moe_pair_gemm1",
                                  "moe_pair_gemm2_combine"])
def test_pdl_constexpr_adds_only_the_two_griddepcontrol_instructions(name):
    from k3export.plugins.aot import compile_ptx
    fn, types, cx, warps, stages, scalars = _kernels()[name]
    cx = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in cx
             and p.name != "PDL"}, **cx}                           # other constexprs at their defaults (e.g. ROUTE)
    sig = {n: "constexpr" if n in cx or n == "PDL" else "i32" if n in scalars else types.get(n, "*bf16")
           for n in fn.arg_names}
    off = compile_ptx(fn, {n: t for n, t in sig.items() if n != "PDL"}, cx, warps, stages).ptx   # PDL omitted
    off_explicit = compile_ptx(fn, sig, {**cx, "PDL": False}, warps, stages).ptx
    on = compile_ptx(fn, sig, {**cx, "PDL": True}, warps, stages).ptx
    assert _instructions(off) == _instructions(off_explicit)
    assert not any(g in off for g in GDC)
    ins_on = _instructions(on)
    gdc = [k for k, i in enumerate(ins_on) if i.startswith("griddepcontrol")]
    assert [ins_on[k].split()[0].rstrip(";") for k in gdc] == list(GDC), ins_on    # triton 3.6 writes "wait;"
    first_mem = next(k for k, i in enumerate(ins_on) if re.match(r"(ld|st|atom|red|cp\.async)\.(global|shared)", i))
    assert gdc[0] < first_mem
    # Without the two instructions, the same statements: their order, register numbers and debug labels
    # (`$L__tmp<n>:`, one more with PDL) aside (the ld.param / %ctaid reads move around the wait), and the `.reg`
    # declarations' counts (triton 3.6, the GPU image's, gives griddepcontrol's inline asm dummy output registers).
    def body(ins):
        return sorted(re.sub(r"\$L__([a-zA-Z_]+?)\d+", r"$L__\1", re.sub(r"%([a-z]+)\d+", r"%\1", i)) for i in ins
                      if not i.startswith(("griddepcontrol", ".reg ")) and not re.fullmatch(r"\$L__tmp\d+:", i))
    assert body(ins_on) == body(_instructions(off))
    # PDL == EARLY (K3_PDL_EARLY=1): the same two instructions, the signal first, both before any memory access.
    early = _instructions(compile_ptx(fn, sig, {**cx, "PDL": EARLY}, warps, stages).ptx)
    gdc_e = [k for k, i in enumerate(early) if i.startswith("griddepcontrol")]
    assert [early[k].split()[0].rstrip(";") for k in gdc_e] == list(reversed(GDC)), early
    assert gdc_e[-1] < next(k for k, i in enumerate(early) if re.match(r"(ld|st|atom|red|cp\.async)\.(global|shared)", i))
    assert body(early) == body(ins_on)


def test_pdl_args_early_switch(monkeypatch):
    """K3_PDL_EARLY=1 (read at each launch) turns the PDL constexpr into EARLY; without the PDL switch, nothing."""
    t = torch.empty(1)
    assert L.pdl_args(t) == {}                                   # CPU tensor
    monkeypatch.setattr(L, "_pdl_capable", {0: True})
    fake = type("T", (), {"device": torch.device("cuda", 0)})()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("K3_PDL_EARLY", raising=False)
    with L.pdl(True):
        assert L.pdl_args(fake) == {"PDL": True, "launch_pdl": True}
        with L.pdl(True, early=True):
            assert L.pdl_args(fake) == {"PDL": EARLY, "launch_pdl": True}
            monkeypatch.setenv("K3_PDL_EARLY", "0")
            assert L.pdl_args(fake) == {"PDL": True, "launch_pdl": True}
        monkeypatch.setenv("K3_PDL_EARLY", "1")
        assert L.pdl_args(fake) == {"PDL": EARLY, "launch_pdl": True}
    assert L.pdl_args(fake) == {}


def test_twice_switch_launches_the_named_kernels_twice(monkeypatch):
    """`launch` with env K3_TWICE (the decode-step diagnostic): a named kernel's launch runs twice with the same
    arguments, other kernels once; read at each launch."""
    from k3export.plugins import launch as L

    class Kernel:                                    # a stand-in with a JITFunction's `fn` and grid indexing
        def __init__(self, name):
            self.fn, self.calls = type(name, (), {})(), []
            self.fn.__name__ = name

        def __getitem__(self, grid):
            return lambda *a, **k: self.calls.append((grid, a, k))

    a, b = Kernel("a_kernel"), Kernel("b_kernel")
    monkeypatch.delenv("K3_TWICE", raising=False)
    assert L.launch(a) is a
    monkeypatch.setenv("K3_TWICE", "x_kernel,a_kernel")
    L.launch(a)[(3,)](1, n=2)
    L.launch(b)[(3,)](1, n=2)
    assert a.calls == [((3,), (1,), {"n": 2})] * 2 and b.calls == [((3,), (1,), {"n": 2})]


def test_compile_backend_refuses_inductor_pdl_and_signals_early_only_with_pdl():
    """`CompileBackend` refuses Inductor's own PDL option (its kernels load what they deem independent before their
    wait: wrong k3-small prefill logits next to the k3 ops on the H200) before touching the model, and names it;
    `pdl_early=True` (the default) signals early only with PDL on (off altogether on a CPU model)."""
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    from k3export.runtime import CompileBackend
    model = random_model(K3Config.from_name("k3-tiny"), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="triton.enable_pdl"):
        CompileBackend(model, options={"triton.enable_pdl": True})
    from torch._inductor import config
    with config.patch({"triton.enable_pdl": True}), pytest.raises(ValueError, match="TORCHINDUCTOR_ENABLE_PDL"):
        CompileBackend(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not CompileBackend(model).pdl_early
    assert CompileBackend(model, options={"combo_kernels": True}).pdl is False


# ---------------------------------------------------------------------------------------------- the backend switch
def test_compile_backend_runs_its_calls_inside_the_switch():
    """`CompileBackend(pdl=True)` (the default; on only for sm_90+ CUDA models, so forced here on a CPU model)
    runs decode and the in-place decode inside `launch.pdl(True)` (prefill without: no gain measured there), with
    `moe_pdl` the MoE switch on too, and restores both after each call; `pdl=False` (bench `compile-nopdl`) leaves
    them alone."""
    from k3export.bench.model import BACKENDS, COMPILE_VARIANTS
    from k3export.config import K3Config
    from k3export.model import packing
    from k3export.model.weights import random_model
    from k3export.runtime import CompileBackend
    assert COMPILE_VARIANTS["compile-nopdl"] == {"pdl": False} and "compile-nopdl" in BACKENDS
    model = random_model(K3Config.from_name("k3-tiny"), seed=0)
    seen = []
    try:
        for on in (True, False):
            b = CompileBackend(model, pdl=on, moe_pdl=on)
            assert b.pdl is False                                        # CPU model: never on by itself
            b.pdl = on
            b._prefill = lambda *a: seen.append(("prefill", on, L._pdl, L._pdl_moe))
            b._decode = lambda *a: seen.append(("decode", on, L._pdl, L._pdl_moe))
            b._decode_ = lambda *a: seen.append(("decode_", on, L._pdl, L._pdl_moe))
            with L.pdl(False, moe=False):
                b.prefill()
                b.decode()
                b.decode_()
                assert L._pdl is False and L._pdl_moe is False           # restored after each call
    finally:
        packing.unpack_projections(model)
    assert seen == [(k, on, on and k != "prefill", on and k != "prefill") for on in (True, False)
                    for k in ("prefill", "decode", "decode_")]


# ---------------------------------------------------------------------------------------------- GPU
def _compiled_with_pdl(fn) -> list[bool]:
    """launch_pdl of every variant of `fn` in Triton's in-process cache whose PTX has griddepcontrol.wait."""
    out = []
    for cache in fn.device_caches.values():
        for k in cache[0].values():
            out.append(bool(getattr(k.metadata, "launch_pdl", False)) and GDC[0] in k.asm["ptx"])
    return out


def _chain_inputs(seed: int = 0):
    """Inputs of a chain of k3-small-shaped decode launches (fresh random values, never zeros)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype)
    N, n, D = 4, 4, 2048                                        # AttnRes: 4 tokens, 4 sources, d = 2048
    B, H, K, W = 4, 16, 128, 4                                  # KDA: k3-small heads
    Bm, Hm, Lm, R, V = 4, 16, 512, 576, 512                     # MLA decode: k3-small latent (512 + 64)
    x = dict(bank=r(N, n, D), p=r(N, D), y=r(N, D), nw=r(D), pw=r(1, D, scale=0.05), ow=r(D),
             qkv=r(B, 3 * H * K), conv=r(B, 3 * H * K, W - 1), cw=r(3 * H * K, W, scale=0.5), f=r(B, H * K),
             b=r(B, H), g=r(B, H * K), A_log=r(H, dtype=torch.float32, scale=0.1),
             dt_bias=r(H * K, dtype=torch.float32, scale=0.1), onw=r(K), state=r(B, H, K, K, dtype=torch.float32),
             q=r(Bm, Hm, R), cache=r(Bm, Lm, R), new_row=r(Bm, R),
             cache_len=torch.tensor([Lm, Lm // 2, 7, 300], device="cuda"))
    return x, V


def _chain(x: dict, V: int, steps: int):
    """steps x (AttnRes add+norm -> KDA decode in place -> MLA decode (split + combine) -> a torch copy), each
    launch reading what an earlier one wrote; returns the working tensors (updated in place)."""
    from k3export.plugins.attn_res.kernels import attn_res_add_norm_fwd
    from k3export.plugins.kda.kernels import kda_decode_inplace_fwd
    from k3export.plugins.mla.kernels import mla_decode_fwd
    for _ in range(steps):
        p_new, out = attn_res_add_norm_fwd(x["bank"], x["p"], x["y"], x["nw"], x["pw"], 1e-5, x["ow"], 1e-5)
        x["p"].copy_(p_new)
        x["y"].copy_(out)
        o = kda_decode_inplace_fwd(x["qkv"], x["conv"], x["cw"], x["f"], None, x["b"], x["g"], x["A_log"],
                                   x["dt_bias"], x["onw"], x["state"], -5.0, 1e-5)
        x["g"].copy_(o)
        om = mla_decode_fwd(x["q"], x["cache"], x["new_row"], x["cache_len"], 0.07, V)
        x["q"][..., :V].copy_(om)
    return x


@pytest.mark.cuda
def test_chain_in_a_cuda_graph_same_bits_with_and_without_pdl():
    """A CUDA graph of 12 x (AttnRes, KDA in place, MLA split + combine, copies): replayed 3 times, each replay from
    the same inputs, with PDL equal bit for bit to without PDL and to the uncaptured launches."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    from k3export.plugins.attn_res.kernels import attn_res_fwd_kernel
    init, V = _chain_inputs()
    results = {}
    for on in (False, True):
        with L.pdl(on):
            eager = _chain({k: v.clone() for k, v in init.items()}, V, 12)
            work = {k: v.clone() for k, v in init.items()}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                _chain({k: v.clone() for k, v in init.items()}, V, 1)        # warm-up: compile outside capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for k, v in work.items():
                    v.copy_(init[k])
                _chain(work, V, 12)
        reps = []
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            reps.append({k: v.clone() for k, v in work.items()})
        for rep in reps:
            for k in ("p", "y", "g", "conv", "state", "q"):
                assert torch.equal(rep[k], eager[k]), (on, k)
                assert torch.isfinite(rep[k].float()).all(), (on, k)
        results[on] = reps[0]
    for k in ("p", "y", "g", "conv", "state", "q"):
        assert torch.equal(results[True][k], results[False][k]), k
    assert any(_compiled_with_pdl(attn_res_fwd_kernel)), "no AttnRes variant was compiled with launch_pdl"


def _k3_small_run(model, prompts, variant: str, batch: int = 4) -> list[torch.Tensor]:
    """Prefill logits then 8 greedy decode steps' logits (fp32 copies) through the bench backend `variant`, the
    first `batch` prompts (at B = 1 the one-row linears run `k3::gemv`)."""
    from k3export.bench.model import COMPILE_VARIANTS
    from k3export.runtime import CompileBackend, Engine
    backend = CompileBackend(model, **COMPILE_VARIANTS[variant])
    prompts = prompts[:batch]
    eng = Engine(backend, max_batch=batch, max_len=160)
    assert eng.graphed, eng.graph_error
    logits = [eng.prefill(list(range(batch)), prompts).float()]
    for _ in range(8):
        logits.append(eng.decode(logits[-1].argmax(-1)).float().clone())
    return logits


@pytest.fixture(scope="module")
def k3_small_baseline():
    """k3-small bf16, 4 prompts, and two runs of the `compile` backend without PDL (`compile-nopdl`, CUDA-graph
    decode) at B = 4 and two at B = 1."""
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    model = random_model(K3Config.from_name("k3-small"), seed=0, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (37, 5, 120, 64)]
    runs = {b: (_k3_small_run(model, prompts, "compile-nopdl", b), _k3_small_run(model, prompts, "compile-nopdl", b))
            for b in (4, 1)}
    return model, prompts, runs


@pytest.mark.cuda
@pytest.mark.parametrize("variant,batch", [("compile", 4), ("compile", 1), ("compile-moepdl", 1)])
def test_k3_small_compile_backend_same_tokens_and_logits_with_pdl(k3_small_baseline, variant, batch):
    """k3-small bf16 through the `compile` backend (CUDA-graph decode), 4 prompts (or 1: the GEMVs on
    `k3::gemv`, weights loaded before the wait) then 8 greedy steps: with PDL the same tokens and logits as
    without (`compile-nopdl`), at every replay; the AttnRes, KDA and MLA decode kernels (and the GEMV at B = 1)
    were compiled with launch_pdl and griddepcontrol. Bound: the run-to-run difference of two runs without PDL (0
    if the step is deterministic: then bit-identical is required)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    from k3export.plugins.attn_res.kernels import attn_res_fwd_kernel
    from k3export.plugins.kda.kernels import kda_decode_inplace_fwd_kernel
    from k3export.plugins.mla.kernels import mla_decode_combine_kernel, mla_decode_fwd_kernel
    model, prompts, runs = k3_small_baseline
    off, off_again = runs[batch]
    try:
        on = _k3_small_run(model, prompts, variant, batch)
    except RuntimeError as e:
        if "Unexpected optimization option" in str(e):
            pytest.skip(f"this torch has no Inductor PDL option: {str(e)[:80]}")
        raise
    spread = [(a - b).abs().max().item() for a, b in zip(off, off_again)]
    same_tokens = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(off, off_again))
    print(f"run-to-run max |diff| without PDL per step: {spread}")
    for step, (a, b) in enumerate(zip(off, on)):
        diff = (a - b).abs().max().item()
        assert diff <= spread[step], (variant, step, diff, spread[step])
        if same_tokens:
            assert torch.equal(a.argmax(-1), b.argmax(-1)), (variant, step)
    from k3export.plugins.gemv.kernels import gemv_fwd_kernel
    from k3export.plugins.moe import kernels as moe
    fns = [attn_res_fwd_kernel, kda_decode_inplace_fwd_kernel, mla_decode_fwd_kernel, mla_decode_combine_kernel]
    fns += [gemv_fwd_kernel] * (batch == 1)
    if variant == "compile-moepdl":     # k3-small's 64 experts select their top-k inside gemm1: no top-k launch
        fns += [moe.moe_router_fwd_kernel, moe.moe_pair_gemm1_fwd_kernel, moe.moe_pair_gemm2_combine_fwd_kernel]
    for fn in fns:
        assert any(_compiled_with_pdl(fn)), f"{fn.__name__}: no variant compiled with launch_pdl"


def test_barrier_probe_kernels_compile_for_sm90_on_cpu(monkeypatch):
    """scripts/barrier_probe.py (GPU planning probe, not run here): its persistent kernel's grid barrier compiles to
    one release add per program and acquire reads of the counter, bracketed by CTA barriers, and the per-round
    launch to griddepcontrol with PDL."""
    import sys
    from pathlib import Path

    from k3export.plugins.aot import compile_ptx
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    sys.modules.pop("barrier_probe", None)
    import barrier_probe as b
    ptx = compile_ptx(b.persistent_kernel, {"buf": "*i32", "bar": "*i32", "R": "i32", "G": "i32"}, {},
                      num_warps=4).ptx
    assert re.search(r"(atom|red)\.global\.gpu\.release\.add", ptx)      # triton 3.9: red (result unused)
    assert "ld.global.gpu.acquire" in ptx and "bar.sync" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx                  # the last program's reset ticket
    rnd = compile_ptx(b.round_kernel, {"buf": "*i32", "r": "i32", "G": "i32", "PDL": "constexpr"}, {"PDL": True},
                      num_warps=4).ptx
    assert all(g in rnd for g in GDC)


def _ab_decode(monkeypatch):
    import sys
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    sys.modules.pop("ab_decode", None)
    import ab_decode
    return ab_decode


@pytest.mark.parametrize("argv,msg", [(["--set", "A=1", "--backends", "compile"], "--set holds variables"),
                                      (["--env", "X=1", "--set", "Y"], "--set takes NAME=VALUE"),
                                      (["--skeleton", "--fp8"], "bf16 ones"),
                                      (["--background", "0,x"], "takes program counts"),
                                      (["--background", "-1"], "must be >= 0"),
                                      ([], "give at least one")])
def test_ab_decode_refuses_bad_arguments_before_building(monkeypatch, capsys, argv, msg):
    """scripts/ab_decode.py (GPU only) stops on bad arguments before it builds a model: usage error, exit 2."""
    ab = _ab_decode(monkeypatch)
    monkeypatch.setattr("sys.argv", ["ab_decode.py", *argv])
    with pytest.raises(SystemExit) as e:
        ab.main()
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_ab_decode_skeleton_keeps_the_kernel_chain_and_drops_the_bytes(monkeypatch):
    """`--skeleton`'s config: k3-small's layers, layer kinds, heads, head dims and experts, at widths where a B = 1
    decode step moves under 8% of k3-small's bytes (1458 -> 106 MB at context 1024)."""
    from dataclasses import replace
    from k3export.bench.model import decode_bytes, param_bytes
    from k3export.config import K3Config
    ab = _ab_decode(monkeypatch)
    base = K3Config.from_name("k3-small")
    sk = replace(base, **ab.SKELETON)
    for field in ("num_hidden_layers", "mla_layers", "num_experts", "num_experts_per_token", "num_shared_experts",
                  "num_attention_heads", "qk_head_dim", "v_head_dim", "kv_lora_rank", "linear_attn_config"):
        assert getattr(sk, field) == getattr(base, field), field
    full, small = (decode_bytes(c, torch.bfloat16, param_bytes(c, torch.bfloat16), 1, 1024) for c in (base, sk))
    assert 1.4e9 < full < 1.5e9 and small < 0.08 * full, (full, small)
