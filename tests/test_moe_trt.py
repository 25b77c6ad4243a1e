"""AOT launch contracts of the MoE decode chain (`plugins/moe/trt.py`): six launches that together compute
`k3::moe_routed` for N k <= 4096 pairs.

CPU, no GPU: the PTX for sm_90 compiles for every launch at K3 shapes (896 experts, top-16, L 3584, I 3072, bf16,
N 1 and 64) and at a tiny shape; each contract's parameters match its PTX entry (count, pointer/scalar order);
grids, constants, warps and scalars equal what the torch launcher (`kernels.moe_routed_fwd`) passes for the same
shapes (its launches recorded on meta tensors, nothing runs); grids and intermediate shapes are expressions of
the shapes alone (evaluated on a symbolic N). Interpreter (TRITON_INTERPRET=1, subprocess): the chain's own
wrapper kernels, launched with the contracts' grids/scalars/constants, against `moe_routed_fwd` and the fp64
reference. GPU (`cuda`, never run yet): the PTX through the CUDA driver (cupy) at K3 size against
`torch.ops.k3.moe_routed`. TensorRT itself: skipped, not installable here; `register_plugins` runs against a
stand-in of `tensorrt.plugin` (its registration checks, shape expressions on a symbolic N) instead.

Error = max |chain - reference| / max |reference| on the same inputs.
"""

from __future__ import annotations

import json
import os

if __name__ == "__main__":  # the interpreter run (see `interp` in conftest.py): set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from k3export.plugins.moe.naive import moe_sorted
from k3export.plugins.moe.trt import decode_tiles
# Named bounds. fp32 / fp16 vs fp64 and bf16 vs moe_sorted (GPU): those of tests/test_moe_kernels.py, with their
# reasons there (same kernels, same tiles).
from test_moe_kernels import BF16_BOUND, FP16_BOUND, FP32_BOUND, SITU
from trt_standin import Sym as _Sym, ev as _ev, install, sym_min as _sym_min

# bf16 chain vs torch.ops.k3.moe_routed (GPU): the same kernels, tiles and summation orders; the wrappers make
# scaling/beta/linear_beta compile-time constants (an ulp of fp32 in the activation may flip one bf16 rounding of
# h, 2^-8 of one of I*k terms), and with max_tokens > N the router is not split over d (fp32 reordering).
CHAIN_BOUND = 2e-3
K3 = dict(d=7168, E=896, top_k=16, L=3584, I=3072)
TINY = dict(d=64, E=16, top_k=4, L=32, I=48)
TRT_SKIP = "TensorRT is not installable here (docs/deployment-notes)"


def _rel(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _steps(N, shape, dtype, **kw):
    from k3export.plugins.moe import trt
    return trt.decode_steps(N, shape["d"], shape["E"], shape["top_k"], shape["L"], shape["I"], dtype, **kw)


# ---------------------------------------------------------------------------------------------- PTX (CPU)
CASES = {"k3-bf16-n1": (1, K3, torch.bfloat16), "k3-bf16-n64": (64, K3, torch.bfloat16),
         "tiny-fp16-n5": (5, TINY, torch.float16), "tiny-fp32-n5": (5, TINY, torch.float32)}


@pytest.fixture(scope="module")
def launches():
    """case -> [(Step, Launch)], compiled once per module (the K3 GEMM tiles take ~1 s each)."""
    return {c: [(s, s.launch()) for s in _steps(*args)] for c, args in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_ptx_compiles_for_sm90(launches, case):
    names = [s.plugin for s, _ in launches[case]]
    assert names == ["k3::moe_router", "k3::moe_topk", "k3::moe_align", "k3::moe_gemm1", "k3::moe_gemm2",
                     "k3::moe_combine"]
    for step, launch in launches[case]:
        ptx = launch.kernel.ptx
        assert ".target sm_90" in ptx and f".entry {launch.kernel.name}(" in ptx
        assert launch.kernel.name == step.fn.__name__
        assert launch.block == (step.num_warps * 32, 1, 1)
        assert launch.kernel.shared_mem <= 227 * 1024, (step.plugin, launch.kernel.shared_mem)   # sm_90 per block
        assert all(isinstance(g, int) and g >= 1 for g in launch.grid)


@pytest.mark.parametrize("case", list(CASES))
def test_params_match_ptx_entry(launches, case):
    """inputs..., scalars..., outputs... in the wrapper's own order; the PTX entry has exactly these parameters
    (pointer = .u64, i32 = .u32, position by position) plus Triton's two trailing scratch pointers."""
    import re

    from k3export.plugins.aot import _entry_params
    for step, launch in launches[case]:
        names = [n for n, _ in step.params]
        assert names == [a for a in step.fn.arg_names if a not in step.constexprs]
        assert names == [*step.inputs, *step.scalars, *step.outputs], step.plugin
        assert all(t.startswith("*") for n, t in step.params if n in step.inputs + step.outputs)
        assert all(t == "i32" for n, t in step.params if n in step.scalars)
        entry = re.search(r"\.entry\s+" + launch.kernel.name + r"\s*\((.*?)\)", launch.kernel.ptx, re.S).group(1)
        decls = [d.strip() for d in entry.split(",")]
        assert len(_entry_params(launch.kernel.ptx, launch.kernel.name)) == len(decls)
        assert launch.kernel.hidden_params == 2 and len(decls) == len(step.params) + 2, step.plugin
        for (n, t), decl in zip(step.params + (("scratch", "*"), ("profile", "*")), decls):
            assert decl.startswith(".param .u64 .ptr" if t.startswith("*") else ".param .u32"), (step.plugin, n,
                                                                                                  decl)


# ---------------------------------------------------------------------------------------------- torch launcher
class _Recorder:
    """Stands in for a `@triton.jit` kernel: records grid, arguments by name and launch options, runs nothing."""

    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        def launch(*args, **kw):
            named = dict(zip(self.fn.arg_names, args))
            opts = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
            self.log.append((self.fn.__name__, tuple(grid), {**named, **kw}, opts))
        return launch


# kernel param name -> chain tensor name, per kernel (where they differ)
_TENSOR_NAMES = {"moe_router_fwd_kernel": {"s": "part", "g": "gate_weight"},
                 "moe_gemm1_fwd_kernel": {"a": "z"}}


def _torch_launches(N, shape, dtype, monkeypatch):
    """What `moe_routed_fwd` launches for these shapes, on meta tensors (no data, nothing runs)."""
    from k3export.plugins.moe import kernels
    log = []
    for name in ("moe_router_fwd_kernel", "moe_topk_fwd_kernel", "moe_align_fwd_kernel", "moe_gemm1_fwd_kernel",
                 "moe_gemm2_fwd_kernel", "moe_combine_fwd_kernel"):
        monkeypatch.setattr(kernels, name, _Recorder(getattr(kernels, name), log))
    d, E, k, L, I = (shape[n] for n in ("d", "E", "top_k", "L", "I"))
    meta = dict(device="meta", dtype=dtype)
    kernels.moe_routed_fwd(torch.empty(N, d, **meta), torch.empty(N, L, **meta), torch.empty(E, d, **meta),
                           torch.empty(E, device="meta"), torch.empty(E, I, L, **meta), torch.empty(E, I, L, **meta),
                           torch.empty(E, L, I, **meta), k, True, 2.5, tiles=decode_tiles(dtype), **SITU)
    return log


@pytest.mark.parametrize("N,shape,dtype", [(1, K3, torch.bfloat16), (5, K3, torch.bfloat16),
                                           (64, K3, torch.bfloat16), (65, K3, torch.bfloat16),
                                           (256, K3, torch.bfloat16), (1, TINY, torch.float16),
                                           (5, TINY, torch.float32), (20, TINY, torch.float16)])
def test_contract_equals_torch_launcher(N, shape, dtype, monkeypatch):
    """Grid, num_warps/num_stages, every scalar and constant, and every tensor's numel and dtype equal what
    `moe_routed_fwd` passes to the same kernels for the same shapes (the wrappers only reorder them)."""
    from k3export.plugins.moe import trt
    log = _torch_launches(N, shape, dtype, monkeypatch)
    steps = _steps(N, shape, dtype, scaling=2.5, **SITU)
    assert len(log) == len(steps) == 6
    d, E, k, L, I = (shape[n] for n in ("d", "E", "top_k", "L", "I"))
    chain = {n: (s, dt) for n, (s, dt) in trt.decode_intermediates(N, E, k, L, I, dtype).items()}
    chain.update(x=((N, d), dtype), gate_weight=((E, d), dtype), bias=((E,), torch.float32), z=((N, L), dtype),
                 w1=((E, I, L), dtype), w3=((E, I, L), dtype), w2=((E, L, I), dtype), u=((N, L), dtype))
    for (kname, grid, args, opts), step in zip(log, steps):
        assert step.grid == grid + (1,) * (3 - len(grid)), (kname, step.grid, grid)
        assert step.num_warps == opts["num_warps"] and step.num_stages == opts.get("num_stages", 3), kname
        mine = {**step.scalars, **step.constexprs}
        for name, value in args.items():
            if isinstance(value, torch.Tensor):
                if kname == "moe_topk_fwd_kernel" and step.constexprs["SPLITS"] == 1 and name == "s":
                    name = "part"                      # unsplit router: s and part are the same tensor
                shp, dt = chain[_TENSOR_NAMES.get(kname, {}).get(name, name)]
                assert value.numel() == torch.Size(shp).numel() and value.dtype == dt, (kname, name)
            else:
                assert mine[name] == value, (kname, name, mine[name], value)
        assert set(mine) >= {n for n, v in args.items() if not isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("shape,dtype,max_tokens", [(K3, torch.bfloat16, 64), (K3, torch.bfloat16, 256),
                                                   (TINY, torch.float16, 20)])
def test_grids_and_intermediates_are_shape_expressions(shape, dtype, max_tokens):
    """With N symbolic (only + - * // and min), grids, scalars and intermediate shapes still build, and evaluate
    for each N <= max_tokens to the ints of the int-N contract compiled for the same max_tokens: they depend on
    the shapes alone, never on routing; the compiled constants do not depend on N at all."""
    from k3export.plugins.moe import trt
    N = _Sym(lambda n: n)
    d, E, k, L, I = (shape[n] for n in ("d", "E", "top_k", "L", "I"))
    sym = _steps(N, shape, dtype, max_tokens=max_tokens, minimum=_sym_min)
    sym_inter = trt.decode_intermediates(N, E, k, L, I, dtype, max_tokens, _sym_min)
    for n in (1, 3, max_tokens):
        ref = _steps(n, shape, dtype, max_tokens=max_tokens)
        for s, r in zip(sym, ref):
            assert tuple(_ev(g, n) for g in s.grid) == r.grid and s.constexprs == r.constexprs
            assert {a: _ev(v, n) for a, v in s.scalars.items()} == r.scalars and s.params == r.params
        ref_inter = trt.decode_intermediates(n, E, k, L, I, dtype, max_tokens)
        assert {a: (tuple(_ev(x, n) for x in shp), dt) for a, (shp, dt) in sym_inter.items()} == ref_inter


def test_prefill_is_refused():
    with pytest.raises(ValueError, match="IPluginV3"):
        _steps(257, K3, torch.bfloat16)                   # 4112 pairs: the torch align path, not an AOT chain
    with pytest.raises(ValueError, match="max_tokens"):
        _steps(_Sym(lambda n: n), K3, torch.bfloat16)


def test_tensorrt_plugins():
    pytest.importorskip("tensorrt", reason=TRT_SKIP)
    from k3export.plugins.moe import trt
    assert trt.register_plugins()


def test_plugin_registration_against_a_stand_in(monkeypatch):
    """`register_plugins` on the stand-in above, then a build of the chain on a symbolic N: each plugin's output
    descriptors feed the next; evaluated at N = 1 and max_tokens, every output shape/dtype, grid, block, shared
    memory, kernel name/PTX and extra argument equals the int contract (`decode_steps` for that N)."""
    from k3export.plugins.moe import trt as moe_trt
    fake_trt, trtp = install(monkeypatch)
    assert moe_trt.register_plugins()
    assert set(trtp.aot) == set(trtp.registered) == {s.plugin for s in _steps(1, TINY, torch.float16)}

    d, E, k, L, I = (TINY[n] for n in ("d", "E", "top_k", "L", "I"))
    max_tokens, N = 20, _Sym(lambda n: n)
    attrs = dict(max_tokens=max_tokens, top_k=k, renormalize=True, scaling=2.5, num_experts=E, **SITU)
    T = trtp.TensorDesc
    f16, f32 = fake_trt.float16, fake_trt.float32
    descs = dict(x=T((N, d), f16), gate_weight=T((E, d), f16), bias=T((E,), f32), z=T((N, L), f16),
                 w1=T((E, I, L), f16), w3=T((E, I, L), f16), w2=T((E, L, I), f16))
    built = {}
    for step in _steps(1, TINY, torch.float16):
        fn, tensors, attr_names, n_out = trtp.registered[step.plugin]
        ins = [descs[t] for t in tensors]
        outs = fn(*ins, **{a: attrs[a] for a in attr_names})
        assert len(outs) == n_out == len(step.outputs), step.plugin
        descs.update(zip(step.outputs, outs))
        aot_fn = trtp.aot[step.plugin]
        used = [a for a in attr_names if a in aot_fn.__code__.co_varnames]
        built[step.plugin] = (aot_fn(*ins, **{a: attrs[a] for a in used}, outputs=outs, tactic=0), outs)
    dtypes = {torch.float16: f16, torch.float32: f32, torch.int32: fake_trt.int32}
    for n in (1, max_tokens):
        inter = moe_trt.decode_intermediates(n, E, k, L, I, torch.float16, max_tokens)
        inter["u"] = ((n, L), torch.float16)
        for step in _steps(n, TINY, torch.float16, max_tokens=max_tokens, scaling=2.5, **SITU):
            (name, ptx, params, extra), outs = built[step.plugin]
            launch = step.launch()
            assert (name, ptx) == (launch.kernel.name, launch.kernel.ptx), step.plugin
            assert tuple(_ev(g, n) for g in (params.grid_x, params.grid_y, params.grid_z)) == step.grid
            assert (params.block_x, params.shared_mem) == (launch.block[0], launch.kernel.shared_mem)
            assert [_ev(v, n) for v in extra] == list(step.scalars.values()), step.plugin
            for o, out in zip(step.outputs, outs):
                shape, dt = inter[o]
                assert tuple(_ev(x, n) for x in out.shape_expr) == tuple(shape) and out.dtype == dtypes[dt], o


# ---------------------------------------------------------------------------------------------- interpreter
def _run_chain(steps, tensors: dict, max_tokens, launch) -> torch.Tensor:
    """Allocate the intermediates (as the contract declares them) and u, run the six steps with
    `launch(step, tensors bound to its pointer params)`, return u."""
    from k3export.plugins.moe import trt
    N, L = tensors["z"].shape
    E, I = tensors["w1"].shape[:2]
    dev, dtype = tensors["z"].device, tensors["z"].dtype
    inter = trt.decode_intermediates(N, E, steps[1].constexprs["K"], L, I, dtype, max_tokens)
    bufs = {n: torch.empty(shp, device=dev, dtype=dt) for n, (shp, dt) in inter.items()}
    bufs["u"] = torch.empty(N, L, device=dev, dtype=dtype)
    for step in steps:
        launch(step, trt.bind(step, {**tensors, **bufs}))
    return bufs["u"]


def _interpret(step, tensors):
    step.fn[step.grid](**tensors, **step.scalars, **step.constexprs, num_warps=step.num_warps,
                       num_stages=step.num_stages)


def _interpreter_cases() -> dict:
    from k3export.plugins.moe.kernels import moe_routed_fwd
    res = {}
    s = TINY
    for name, dt in {"fp32": torch.float32, "fp16": torch.float16}.items():
        for N, max_tokens in ((1, None), (5, 80), (20, None)):      # PTX for 80 tokens run on 5
            torch.manual_seed(N)
            x, z = torch.randn(N, s["d"], dtype=dt), torch.randn(N, s["L"], dtype=dt)
            g = torch.randn(s["E"], s["d"], dtype=dt) * s["d"] ** -0.5
            b = torch.randn(s["E"]) * 0.1
            w1 = torch.randn(s["E"], s["I"], s["L"], dtype=dt) * s["L"] ** -0.5
            w3 = torch.randn(s["E"], s["I"], s["L"], dtype=dt) * s["L"] ** -0.5
            w2 = torch.randn(s["E"], s["L"], s["I"], dtype=dt) * s["I"] ** -0.5
            steps = _steps(N, s, dt, scaling=2.5, max_tokens=max_tokens, **SITU)
            u = _run_chain(steps, dict(x=x, gate_weight=g, bias=b, z=z, w1=w1, w3=w3, w2=w2), max_tokens,
                           _interpret)
            op = moe_routed_fwd(x, z, g, b, w1, w3, w2, s["top_k"], True, 2.5, tiles=decode_tiles(dt), **SITU)
            ref = moe_sorted(x.double(), z.double(), g.double(), b, w1.double(), w3.double(), w2.double(),
                             s["top_k"], True, 2.5, **SITU)
            case = f"{name}-n{N}-max{max_tokens or N}"
            res[f"ref-{case}"] = _rel(u, ref)
            res[f"op-{case}"] = _rel(u, op)
    return res


_INTERP = [f"{n}-n{N}-max{m}" for n in ("fp32", "fp16") for N, m in ((1, 1), (5, 80), (20, 20))]


@pytest.mark.parametrize("case", _INTERP)
def test_interpreted_chain_vs_reference(interp, case):
    assert interp[f"ref-{case}"] < (FP32_BOUND if case.startswith("fp32") else FP16_BOUND), interp


@pytest.mark.parametrize("case", [c for c in _INTERP if c.split("-n")[1].split("-max")[0] ==
                                  c.split("-max")[1]])
def test_interpreted_chain_equals_op(interp, case):
    """max_tokens = N: the same kernels with the same arguments as `moe_routed_fwd`, so the same result bit for
    bit under the interpreter (it evaluates the constant-folded floats identically)."""
    assert interp[f"op-{case}"] == 0.0, interp


# ---------------------------------------------------------------------------------------------- GPU, K3 shapes
@pytest.fixture(scope="module")
def k3_weights():
    """K3's router and routed experts at full size in bf16 (59 GB), random, built once."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    c = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    d, E, L, I = (K3[n] for n in ("d", "E", "L", "I"))
    w = dict(gate_weight=torch.randn(E, d, **c) * d ** -0.5, bias=torch.randn(E, device="cuda", generator=gen) * 0.1,
             w1=torch.randn(E, I, L, **c) * L ** -0.5, w3=torch.randn(E, I, L, **c) * L ** -0.5,
             w2=torch.randn(E, L, I, **c) * I ** -0.5)
    yield w
    del w
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.parametrize("N,max_tokens", [(1, None), (64, None), (5, 256)])
def test_chain_through_cupy_k3(k3_weights, N, max_tokens):
    """The six PTX launches through the CUDA driver at K3 size vs the op's row-plan path and moe_sorted on fresh
    random inputs, on the tokens whose top-16 selection is clear (a near-tie at the boundary may pick another
    expert under other rounding). (5, 256): PTX compiled for 256 tokens, run on 5 (a dynamic-shape engine)."""
    pytest.importorskip("cupy", reason="cupy launches the PTX through the CUDA driver")
    from k3export.plugins.aot import launch_cupy
    gen = torch.Generator(device="cuda").manual_seed(1000 + N)
    wt = k3_weights
    x = torch.randn(N, K3["d"], device="cuda", dtype=torch.bfloat16, generator=gen)
    z = torch.randn(N, K3["L"], device="cuda", dtype=torch.bfloat16, generator=gen)
    k = K3["top_k"]
    steps = _steps(N, K3, torch.bfloat16, max_tokens=max_tokens, **SITU)
    u = _run_chain(steps, dict(x=x, z=z, **wt), max_tokens, lambda step, t: launch_cupy(step.launch(), t))
    args = (x, z, wt["gate_weight"], wt["bias"], wt["w1"], wt["w3"], wt["w2"], k, True, 1.0, 4.0, 25.0)
    from k3export.plugins.moe.kernels import moe_routed_fwd
    op = moe_routed_fwd(*args[:7], *args[7:10], beta=args[10], linear_beta=args[11], tiles=decode_tiles(x.dtype))
    ref = moe_sorted(*args)
    top = torch.topk(torch.sigmoid(x.float() @ wt["gate_weight"].float().T) + wt["bias"], k + 1, dim=-1).values
    clear = (top[:, k - 1] - top[:, k]) > 1e-5
    assert clear.any(), "every token has a near-tie on this draw"
    err_op = ((u.double() - op.double())[clear].abs().max() / op.double().abs().max()).item()
    err_ref = ((u.double() - ref.double())[clear].abs().max() / ref.double().abs().max()).item()
    print(f"moe trt chain N={N} max_tokens={max_tokens}: vs op {err_op:.2e}, vs moe_sorted {err_ref:.2e} on "
          f"{int(clear.sum())}/{N} clear tokens")
    assert u.shape == z.shape and err_op < CHAIN_BOUND and err_ref < BF16_BOUND


if __name__ == "__main__":
    print(json.dumps(_interpreter_cases()))
