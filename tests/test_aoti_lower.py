"""The AOTI lowering pass (`k3export.aoti_lower`), checked on graph structure without a GPU: graphs exported on
the meta device (no weights; the lowering traces the launchers on fake tensors), each k3 op replaced by its
Triton launches as `triton_kernel_wrapper_functional` nodes, the dynamic dims kept. The config is k3-tiny cut
to 4 layers (3 KDA + 1 MLA) with KDA heads of 128 so the KDA prefill kernel applies, as it does for K3.

Runtime numerics of the compiled packages are the GPU test's job (tests/test_aoti_cuda.py); without a driver
Triton cannot produce the kernels' TTIR, so the functionalization here assumes every kernel argument is written
(a warning per launch), which changes no count checked below.

A traced launcher sizes its tiles from the largest value of a dynamic dim (`plugins/launch.size_bound`), then runs
at smaller sizes: the interpreter cases run the MoE and MLA prefill launchers with every bound 16x the real size,
in fp16 under TRITON_INTERPRET=1, against the fp64 twins (bounds from the ops' own kernel tests)."""

import dataclasses
import json
import os

if __name__ == "__main__":  # the interpreter run (see `interp` in conftest.py): the flag must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from k3export.aoti_lower import Lowering, LOWERINGS, k3_nodes, lower_k3_ops, op_name, plan
from k3export.config import K3Config
from k3export.export import (EXAMPLE, DecodeGraph, ExportLimits, PrefillGraph, dynamic_shapes, example_inputs,
                             io_specs, k3_op_counts)
from k3export.model.k3 import K3Model
from k3export.model.weights import param_dtype
from k3export.plugins.launch import size_bound, traced_launches

LIMITS = ExportLimits(max_batch=4, max_tokens=64, max_cache=128)
# Launch nodes per op node of each k3 op (the eager launchers' kernels at these dims).
LAUNCHES = {
    "attn_res": {"attn_res_fwd_kernel": 1},
    "kda_decode": {"kda_decode_fwd_kernel": 1},
    "kda_prefill": {"kda_prefill_akk_fwd_kernel": 1, "kda_prefill_wu_fwd_kernel": 1,   # split intra (K = 128)
                    "kda_prefill_fwd_kernel": 1},
    "mla_decode": {"mla_decode_fwd_kernel": 1, "mla_decode_combine_kernel": 1},
    "mla_prefill": {"mla_prefill_fwd_kernel": 1},
    "moe_routed": {"moe_router_fwd_kernel": 1, "moe_topk_fwd_kernel": 1, "moe_gemm1_fwd_kernel": 1,
                   "moe_gemm2_fwd_kernel": 1, "moe_combine_fwd_kernel": 1},
}


def cut_config() -> K3Config:
    c = K3Config.from_name("k3-tiny")
    lac = dataclasses.replace(c.linear_attn_config, num_heads=1, head_dim=128, kda_layers=(), full_attn_layers=())
    return dataclasses.replace(c, num_hidden_layers=4, linear_attn_config=lac)


@pytest.fixture(scope="module")
def graphs():
    """{graph: ExportedProgram} of the cut config in bf16 on the meta device."""
    cfg, dtype = cut_config(), torch.bfloat16
    with torch.device("meta"):
        model = K3Model(cfg)
    for name, p in model.named_parameters():
        p.data = p.data.to(param_dtype(name, dtype))
    model.eval()
    out = {}
    for name, wrapper in (("prefill", PrefillGraph), ("decode", DecodeGraph)):
        spec = io_specs(cfg, dtype)[name]
        args = example_inputs(spec["inputs"], EXAMPLE, vocab=cfg.vocab_size)
        with torch.no_grad():
            out[name] = torch.export.export(wrapper(model).eval(), tuple(a.to("meta") for a in args.values()),
                                            dynamic_shapes=dynamic_shapes(spec["inputs"], LIMITS))
    return out


def expected_launches(ops: dict[str, int], skip=()) -> dict[str, int]:
    want: dict[str, int] = {}
    for op, n in ops.items():
        for kernel, k in ([] if op in skip else LAUNCHES[op].items()):
            want[kernel] = want.get(kernel, 0) + n * k
    return want


def test_decode_graph_lowers_every_k3_op_into_triton_launches(graphs):
    ep = graphs["decode"]
    ops = k3_op_counts(ep)
    assert set(ops) == {"attn_res", "kda_decode", "mla_decode", "moe_routed"}
    lowered, report = lower_k3_ops(ep)
    assert k3_op_counts(lowered) == {} and report["extern"] == {}
    assert report["compiled_in"] == ops
    want = expected_launches(ops)
    want["moe_align_fwd_kernel"] = ops["moe_routed"]     # decode tiling: the one-program align kernel
    assert report["launches"] == dict(sorted(want.items()))
    wrappers = [n for n in lowered.graph.nodes if n.op == "call_function"
                and n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    assert len(wrappers) == sum(want.values())
    assert lowered.range_constraints == ep.range_constraints            # batch and cache stay dynamic


def test_prefill_graph_lowering_keeps_the_ops_it_is_told_to_keep(graphs, monkeypatch):
    ep = graphs["prefill"]
    ops = k3_op_counts(ep)
    assert set(ops) == {"attn_res", "kda_prefill", "mla_prefill", "moe_routed"}
    monkeypatch.setenv("K3EXPORT_AOTI_EXTERN", "mla_prefill")
    lowered, report = lower_k3_ops(ep)
    assert k3_op_counts(lowered) == {"mla_prefill": ops["mla_prefill"]}
    assert report["extern"] == {"mla_prefill": "kept extern by K3EXPORT_AOTI_EXTERN"}
    assert report["compiled_in"] == {k: v for k, v in ops.items() if k != "mla_prefill"}
    want = expected_launches(ops, skip=("mla_prefill",))
    want["moe_align_fwd_kernel"] = ops["moe_routed"]    # the 2026-11-30 prefill tilings align rows in a Triton kernel
    assert report["launches"] == dict(sorted(want.items()))
    assert lowered.range_constraints == ep.range_constraints            # batch, tokens and past stay dynamic


def test_ops_the_kernels_do_not_serve_stay_extern(graphs):
    """The plan follows the CUDA implementations' own branches: fp32 KDA prefill and float64 calls keep the
    reference, so those nodes are never lowered."""
    q = torch.empty(2, 64, 1, 128, device="meta", dtype=torch.float32)
    kda = LOWERINGS["kda_prefill"]()
    assert "bf16/fp16 with K = V = 128" in kda.why_not(q, q, q, q, None, None, None, q, None, -5.0)
    assert kda.why_not(q.bfloat16(), q, q.bfloat16(), q, None, None, None, q, None, -5.0) is None
    wide = torch.empty(2, 4, 40, device="meta", dtype=torch.float64)
    assert "float64" in LOWERINGS["mla_decode"]().why_not(wide, wide, None, None, 1.0, 16)
    lower, extern = plan(graphs["decode"])
    assert {op_name(op) for op in lower} == {"attn_res", "kda_decode", "mla_decode", "moe_routed"} and not extern
    assert all(isinstance(r, Lowering) for r in lower.values())


def test_size_bound_is_the_export_max_of_a_symbolic_size(graphs):
    assert size_bound(7) == 7
    node = next(n for n in graphs["decode"].graph.nodes if n.op == "placeholder" and n.name == "mla_cache")
    batch, cache = node.meta["val"].shape[1:3]
    assert isinstance(cache, torch.SymInt)
    assert size_bound(cache) == LIMITS.max_cache and size_bound(batch) == LIMITS.max_batch
    assert size_bound(batch * cache + 1) == LIMITS.max_batch * LIMITS.max_cache + 1


def test_launch_is_the_plain_kernel_outside_tracing():
    from k3export.plugins.attn_res.kernels import attn_res_fwd_kernel
    from k3export.plugins.launch import launch
    assert launch(attn_res_fwd_kernel) is attn_res_fwd_kernel
    with traced_launches():
        assert launch(attn_res_fwd_kernel) is not attn_res_fwd_kernel
    assert launch(attn_res_fwd_kernel) is attn_res_fwd_kernel
    assert not k3_nodes(torch.fx.symbolic_trace(torch.nn.Identity()))


def test_load_registers_the_extern_ops_and_refuses_missing_ones(tmp_path):
    from k3export.build import EngineError
    from k3export.build_aoti import load_extern_ops
    cpu = torch.device("cpu")
    assert load_extern_ops({"extern_ops": []}, tmp_path, cpu) == []                  # nothing to import
    assert load_extern_ops({"extern_ops": ["mla_decode"]}, tmp_path, cpu) == ["mla_decode"]
    assert len(load_extern_ops({}, tmp_path, cpu)) == 6                # a manifest from before the lowering pass
    with pytest.raises(EngineError, match=r"not registered: \['mla_decode_v9'\]"):
        load_extern_ops({"extern_ops": ["mla_decode", "mla_decode_v9"]}, tmp_path, cpu)


def test_cuda_cache_key_follows_the_kernel_switches(monkeypatch):
    from k3export.build_aoti import kernels_fingerprint
    assert kernels_fingerprint("cpu") is None                           # CPU packages hold no k3 kernel
    before = kernels_fingerprint("cuda")
    monkeypatch.setenv("K3_ATTN_RES_TRITON", "0")                      # a kernel switch
    after = kernels_fingerprint("cuda")
    assert after != before
    monkeypatch.setenv("K3EXPORT_AOTI_KERNELS", "1")                  # compiling the kernels in (opt-in)
    assert kernels_fingerprint("cuda") != after


# ---------------------------------------------------------------------------------------------- bound-sized launches
INFLATE = 16            # size_bound(n) = 16 n: the tiles a traced launch picks for a dim whose max is 16x the call


def _interpreter_cases() -> dict:
    """Run in this process under TRITON_INTERPRET=1 -> {case: relative error vs the fp64 twin}."""
    from k3export.plugins.mla import kernels as mla
    from k3export.plugins.mla.naive import mla_prefill_attention
    from k3export.plugins.moe import kernels as moe
    from k3export.plugins.moe.naive import moe_sorted
    from test_moe_kernels import SITU, _rel, _weights
    res = {}
    mla.size_bound = moe.size_bound = lambda n: INFLATE * n
    torch.manual_seed(0)
    d, E, I, L, k = 48, 12, 40, 24, 4
    g, b, w1, w3, w2 = _weights(E, d, L, I, torch.float16)
    for N in (3, 5):                                  # bounds 48 / 80 tokens: router split over d or not
        x, z = torch.randn(N, d, dtype=torch.float16), torch.randn(N, L, dtype=torch.float16)
        ref = moe_sorted(*(t.double() for t in (x, z, g)), b, *(t.double() for t in (w1, w3, w2)), k, True, 2.5,
                         **SITU)
        for name, cfg in moe.CONFIGS.items():         # every regime the lowering can pick, as it runs it (no TMA)
            u = moe.moe_routed_fwd(x, z, g, b, w1, w3, w2, k, True, 2.5, tiles=dataclasses.replace(cfg, tma=""),
                                   **SITU)
            res[f"moe-{name}-N{N}"] = _rel(u, ref)
    B, T, H, D, Dv, Lc = 2, 5, 2, 24, 16, 4          # block_m from 16 x 5 tokens: 128 rows for 5
    q, kk, v = (torch.randn(*s).half() for s in ((B, T, H, D), (B, Lc + T, H, D), (B, Lc + T, H, Dv)))
    past = torch.tensor([4, 1])
    o = mla.mla_prefill_fwd(q, kk, v, past, 0.2)
    res["mla-prefill"] = _rel(o, mla_prefill_attention(q.double(), kk.double(), v.double(), past, 0.2))
    return res


def _bound_cases():
    from test_mla_kernels import FP16_BOUND as MLA_FP16
    from test_moe_kernels import FP16_BOUND as MOE_FP16
    from k3export.plugins.moe.kernels import CONFIGS
    return [(f"moe-{name}-N{n}", MOE_FP16) for name in CONFIGS for n in (3, 5)] + [("mla-prefill", MLA_FP16)]


@pytest.mark.parametrize("case,bound", _bound_cases())
def test_launchers_sized_by_a_larger_bound_stay_exact(interp, case, bound):
    assert interp[case] < bound, interp


if __name__ == "__main__":
    print(json.dumps(_interpreter_cases()))


# ---------------------------------------------------------------------------------------------- fp64 float arguments
def _float_args_kernels():
    from k3export.plugins.attn_res.kernels import attn_res_fwd_kernel
    from k3export.plugins.mla.kernels import mla_decode_combine_kernel, mla_decode_fwd_kernel, mla_prefill_fwd_kernel
    from k3export.plugins.moe.kernels import moe_gemm1_fwd_kernel, moe_topk_fwd_kernel
    bf16_dot = dict(DOT_PREC="tf32")
    return {
        "mla_decode": (mla_decode_fwd_kernel, ("qk_scale",),
                       dict(BLOCK_H=32, BLOCK_N=32, BLOCK_V=512, BLOCK_PE=64, **bf16_dot)),
        "mla_combine": (mla_decode_combine_kernel, ("qk_scale",), dict(BLOCK_V=512, BLOCK_PE=64, BLOCK_S=8,
                                                                       BLOCK_C=16, BLOCK_VC=128)),
        "mla_prefill": (mla_prefill_fwd_kernel, ("qk_scale",),
                        dict(BLOCK_M=128, BLOCK_N=64, BLOCK_A=128, BLOCK_B=64, HAS_B=True, BLOCK_V=128, **bf16_dot)),
        "attn_res": (attn_res_fwd_kernel, ("eps",), dict(N_SRC=8, BLOCK_D=256, NORM=False, ow=None, out_eps=0.0,
                                                          ADD=False, dp=None, p_out=None, ONE=False)),
        "attn_res_norm": (attn_res_fwd_kernel, ("eps", "out_eps"), dict(N_SRC=8, BLOCK_D=256, NORM=True, ADD=False,
                                                                        dp=None, p_out=None, ONE=True)),
        "attn_res_add_norm": (attn_res_fwd_kernel, ("eps", "out_eps"), dict(N_SRC=8, BLOCK_D=256, NORM=True,
                                                                            ADD=True, ONE=False)),
        "moe_topk": (moe_topk_fwd_kernel, ("scaling",),
                     dict(K=16, BLOCK_K=16, BLOCK_E=1024, RENORM=True, SPLITS=1, PACKED=True)),
        "moe_gemm1": (moe_gemm1_fwd_kernel, ("beta", "linear_beta"),
                      dict(TOP_K=16, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, A_DESC=False, W_DESC=False, TAIL=0,
                           PAIRED=False, **bf16_dot)),
    }


@pytest.mark.parametrize("name", list(_float_args_kernels()))
def test_kernels_compile_with_fp64_float_arguments(name):
    """Inductor types a Python float kernel argument as fp64 (torch._inductor.codegen.triton_utils.signature_of,
    `_use_fp64_for_unbacked_floats`), so inside an AOTI package the MLA kernels' qk_scale turned their softmax and
    accumulator fp64, and `tl.dot(..., acc=)` asserted (the H200 build of 2026-11-30). Each kernel with a float
    argument casts it to fp32 first: it must compile for sm_90 with fp64 there (no GPU needed)."""
    from k3export.plugins.aot import compile_ptx
    fn, floats, cx = _float_args_kernels()[name]
    sig = {}
    for n in fn.arg_names:
        if n in cx:
            sig[n] = "constexpr"
        elif n in floats:
            sig[n] = "fp64"
        elif n in ("cache_len", "past_len", "ids", "row_pair", "block_expert"):
            sig[n] = "*i32"
        elif n in ("o_part", "lse_part", "s", "part", "bias", "w", "nw", "pw"):
            sig[n] = "*fp32"
        elif n in ("a_tail",):
            sig[n] = "constexpr"
            cx = {**cx, n: None}
        else:
            sig[n] = "*bf16" if n in ("q", "cache", "new_row", "o", "k", "v", "bank", "p", "out", "a", "w1", "w3", "h",
                                      "x", "ow", "dp", "p_out") else "i32"
    kernel = compile_ptx(fn, sig, cx, num_warps=4)
    assert f".entry {kernel.name}(" in kernel.ptx
