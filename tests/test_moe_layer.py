"""`k3::moe_layer_decode` (plugins/moe/layer.py): the LatentMoE sublayer after its input projection as one
persistent launch with grid barriers (experimental; opt-in).

CPU: the kernel's four phases as four launches under TRITON_INTERPRET=1 (a grid barrier would wait forever in the
interpreter, which runs programs one after another), fp32 and fp16, against the op's reference in fp64, with fewer
programs than work items (grid-stride loops, the one-ahead weight prefetch) and more; the PTX of the one-launch
form on sm_90. GPU (`cuda`): k3-small shapes, the persistent launch == the four phase launches bit for bit, eagerly
and in CUDA-graph replays (the barrier counter back at 0 each time), near the reference.
"""

from __future__ import annotations

import json
import os

if __name__ == "__main__":  # the interpreter run (see `interp` in conftest.py): the flag must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

# fp32 vs fp64: sums in another order (router over d, experts over L and I, the output over L + I_s).
FP32_BOUND = 1e-5
# fp16 vs fp64 on the same fp16 inputs: the kernel rounds h, u, the normalised u and y to fp16 (2^-11 = 4.9e-4
# each; measured 3-4e-4).
FP16_BOUND = 2e-3
SITU = dict(beta=4.0, linear_beta=25.0)


def _case(dtype, E=12, d=48, L=24, I=40, IS=20, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device, dt)
    x, z, hs = r(1, d), r(1, L), r(1, IS)
    gate = r(E, d, scale=d ** -0.5, dt=torch.float32)
    bias = r(E, scale=0.1, dt=torch.float32)
    w1, w3 = r(E, I, L, scale=L ** -0.5), r(E, I, L, scale=L ** -0.5)
    w2 = r(E, L, I, scale=I ** -0.5)
    w_out = r(d, L + IS, scale=(L + IS) ** -0.5)
    nw = (1.0 + 0.1 * torch.randn(L, generator=g)).to(device, dtype)
    return [x, z, hs, gate, bias, w1, w3, w2, w_out, nw]


def _ref(args, top_k, renorm):
    from k3export.plugins.moe.layer import moe_layer_decode
    wide = [t.double() if t.is_floating_point() else t for t in args]
    return moe_layer_decode._init_fn(*wide, 1e-5, top_k, renorm, 2.5, SITU["beta"], SITU["linear_beta"])


def _rel(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _interpreter_cases() -> dict:
    from k3export.plugins.moe.kernels import interleave_gate_up
    from k3export.plugins.moe.layer import moe_layer_decode_fwd
    from k3export.plugins.triton_common import tickets
    res = {}
    for name, dt in (("fp32", torch.float32), ("fp16", torch.float16)):
        for top_k, renorm in ((4, True), (1, False)):
            args = _case(dt, seed=top_k)
            ref = _ref(args, top_k, renorm)
            for G in (1, 3, 64):                           # items per program: many / a few / at most one
                for bn in (4, 8):
                    y = moe_layer_decode_fwd(*args, 1e-5, top_k, renorm, 2.5, **SITU, phases=True,
                                             config=dict(programs=G, warps=4, bn1=bn, bn2=bn, bn3=bn))
                    key = f"{name}-k{top_k}"
                    res[key] = max(res.get(key, 0.0), _rel(y, ref))
                    res[f"dtype-{name}"] = float(y.dtype == dt and tuple(y.shape) == (1, 48))
        # gate / up rows interleaved in one tensor (the compile backend's paired layout): w1 / w3 strided views
        args = _case(dt, seed=7)
        paired = list(args)
        paired[5], paired[6] = interleave_gate_up(args[5], args[6])[1:]
        y = moe_layer_decode_fwd(*paired, 1e-5, 4, True, 2.5, **SITU, phases=True,
                                 config=dict(programs=5, warps=4, bn1=4, bn2=4, bn3=4))
        res[f"paired-{name}"] = _rel(y, _ref(args, 4, True))
    res["counter-untouched"] = float(int(tickets(torch.empty(1), 1)[0].item()) == 0)
    return res


@pytest.mark.parametrize("case,bound", [("fp32-k4", FP32_BOUND), ("fp32-k1", FP32_BOUND), ("paired-fp32", FP32_BOUND),
                                        ("fp16-k4", FP16_BOUND), ("fp16-k1", FP16_BOUND),
                                        ("paired-fp16", FP16_BOUND)])
def test_interpreted_phases_vs_reference(interp, case, bound):
    assert interp[case] < bound, interp


def test_interpreted_outputs_and_counter(interp):
    assert interp["dtype-fp32"] == interp["dtype-fp16"] == 1.0 and interp["counter-untouched"] == 1.0, interp


def test_reference_is_the_sublayer_after_its_projection():
    """The op's reference (CPU) == LatentMoE's routed sum, latent norm and output projections on the unpacked
    module (k3-tiny fp32): the op computes what the model does after `project_hidden`."""
    from k3export.config import K3Config
    from k3export.model.moe import LatentMoE
    from k3export.model.weights import random_model
    from k3export.plugins.moe.layer import moe_layer_decode
    model = random_model(K3Config.from_name("k3-tiny"), seed=0)
    moe = next(m for m in model.modules() if isinstance(m, LatentMoE))
    x = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z, h = moe.project_hidden(x)
        want = moe.norm_output(moe.routed(x, z), h)
        s = moe.shared_experts
        w_out = torch.cat([moe.routed_expert_up_proj.weight, s.down_proj.weight], dim=1)
        r = moe.routing
        y = moe_layer_decode(x, z, h, moe.gate.weight, moe.gate.e_score_correction_bias, moe.experts.w1,
                             moe.experts.w3, moe.experts.w2, w_out, moe.routed_expert_norm.weight,
                             moe.routed_expert_norm.eps, r["top_k"], r["renormalize"], r["scaling"], r["beta"],
                             r["linear_beta"])
    assert ((y - want).norm() / want.norm()).item() < 1e-6


def test_persistent_swap_installed_and_removed_cpu_path_unchanged():
    """`pack_projections(persistent=True)` swaps every bf16/fp32 LatentMoE's `routed_output` (CPU: its fallback,
    the routed op, the norm and the packed output GEMM: the logits of the model as written to fp32 rounding);
    `unpack_projections` removes it."""
    from k3export.config import K3Config
    from k3export.model import packing
    from k3export.model.moe import LatentMoE
    from k3export.model.weights import random_model
    model = random_model(K3Config.from_name("k3-tiny"), seed=0)
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    ids = torch.tensor([[5, 17, 3, 99, 42]])
    with torch.no_grad():
        want = model(ids)
        packing.pack_projections(model, glu=True, persistent=True)
        assert moes and all(isinstance(m.__dict__.get("routed_output"), packing.PersistentMoE) for m in moes)
        got = model(ids)
    packing.unpack_projections(model)
    assert all("routed_output" not in m.__dict__ for m in moes)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_persistent_launch_compiles_for_sm90_on_cpu():
    """The one-launch form (PHASE 0, PDL) compiles to sm_90 PTX: three grid barriers (a release add and acquire
    reads of the counter each), the last program's reset ticket, griddepcontrol first."""
    import re

    from k3export.plugins.aot import compile_ptx
    from k3export.plugins.moe.layer import moe_layer_decode_kernel
    ptrs = dict(x="*bf16", z="*bf16", hs="*bf16", g="*fp32", bias="*fp32", w1="*bf16", w3="*bf16", w2="*bf16",
                w_out="*bf16", nw="*bf16", y="*bf16", logits="*fp32", h="*bf16", u="*bf16", bar="*i32")
    ints = ("D", "E", "L", "I", "IS", "stride_we", "stride_wi")
    floats = ("eps", "scaling", "beta", "linear_beta")
    cx = dict(K=8, BLOCK_K=8, BLOCK_E=64, BD=2048, BL=1024, BI=1024, BO=4096, BN1=4, BN2=4, BN3=4, RENORM=True,
              PHASE=0, PDL=True)
    sig = {n: ptrs.get(n, "i32" if n in ints else "fp32" if n in floats else "constexpr")
           for n in moe_layer_decode_kernel.arg_names}
    ptx = compile_ptx(moe_layer_decode_kernel, sig, cx, num_warps=8).ptx
    assert len(re.findall(r"(atom|red)\.global\.gpu\.release\.add", ptx)) == 3, "one arrive per barrier"
    assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.gpu.acquire" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


@pytest.mark.cuda
def test_persistent_equals_phases_k3_small_cuda():
    """k3-small shapes (d 2048, 64 experts top-8, L 1024, I 768, I_s 1536), bf16: the persistent launch (3 grid
    barriers, PDL on sm_90) == the four phase launches bit for bit, eagerly and in 3 CUDA-graph replays (the
    counter back at 0 after each), and within 2^-6 of the fp64 reference relative to max |y| (bf16 roundings of
    h, u, the normalised u and y: a few 2^-9 each; near-tie routings excluded by the draw's seed check)."""
    from k3export.plugins import launch as L
    from k3export.plugins.moe.layer import moe_layer_decode_fwd
    from k3export.plugins.triton_common import tickets
    args = _case(torch.bfloat16, E=64, d=2048, L=1024, I=768, IS=1536, seed=3, device="cuda")
    opts = (1e-5, 8, True, 2.5, SITU["beta"], SITU["linear_beta"])
    ref = _ref(args, 8, True)
    phases = moe_layer_decode_fwd(*args, *opts, phases=True)
    with L.pdl(torch.cuda.get_device_capability()[0] >= 9, early=True):
        one = moe_layer_decode_fwd(*args, *opts)
        torch.cuda.synchronize()
        assert int(tickets(one, 1)[0].item()) == 0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_layer_decode_fwd(*args, *opts)
    reps = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        reps.append(out.clone())
        assert int(tickets(one, 1)[0].item()) == 0
    assert torch.equal(one, phases) and all(torch.equal(r, one) for r in reps)
    err = _rel(one, ref)
    print(f"moe_layer_decode k3-small: persistent == phases (eager, 3 replays); vs fp64 reference {err:.2e}")
    assert err < 2.0 ** -6


if __name__ == "__main__":
    print(json.dumps(_interpreter_cases()))
