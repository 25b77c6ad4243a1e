"""AOT launch contracts of the MoE chains (`plugins/moe/trt.py`): six launches that together compute
`k3::moe_routed` for N k <= 4096 pairs (decode), eight for more (prefill: the chunked align's three launches in
place of the one-program align, pointer-load prefill tilings).

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
    return trt.chain_steps(N, shape["d"], shape["E"], shape["top_k"], shape["L"], shape["I"], dtype, **kw)


DECODE_CHAIN = ["k3::moe_router", "k3::moe_topk", "k3::moe_align", "k3::moe_gemm1", "k3::moe_gemm2", "k3::moe_combine"]
PREFILL_CHAIN = ["k3::moe_router", "k3::moe_topk", "k3::moe_count", "k3::moe_plan", "k3::moe_scatter",
                 "k3::moe_gemm1", "k3::moe_gemm2", "k3::moe_combine"]


# ---------------------------------------------------------------------------------------------- PTX (CPU)
CASES = {"k3-bf16-n1": (1, K3, torch.bfloat16), "k3-bf16-n64": (64, K3, torch.bfloat16),
         "tiny-fp16-n5": (5, TINY, torch.float16), "tiny-fp32-n5": (5, TINY, torch.float32),
         "k3-bf16-prefill-n16384": (16384, K3, torch.bfloat16), "tiny-fp16-prefill-n1100": (1100, TINY, torch.float16)}


@pytest.fixture(scope="module")
def launches():
    """case -> [(Step, Launch)], compiled once per module (the K3 GEMM tiles take ~1 s each)."""
    return {c: [(s, s.launch()) for s in _steps(*args)] for c, args in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_ptx_compiles_for_sm90(launches, case):
    names = [s.plugin for s, _ in launches[case]]
    assert names == (PREFILL_CHAIN if "prefill" in case else DECODE_CHAIN)
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
        assert names == [p.name for p in step.fn.params if not p.is_constexpr]
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
                 "moe_gemm1_fwd_kernel": {"a": "z", "a_tail": "z"}, "moe_gemm2_fwd_kernel": {"a_tail": "h"}}


def _torch_launches(N, shape, dtype, monkeypatch, tiles=None):
    """What `moe_routed_fwd` launches for these shapes and the chain's tiling, on meta tensors (no data, nothing
    runs; the prefill router's TMA switched off, as the chain has it: pointer loads)."""
    from k3export.plugins.moe import kernels, trt
    log = []
    for name in ("moe_router_fwd_kernel", "moe_topk_fwd_kernel", "moe_align_fwd_kernel", "moe_chunk_count_fwd_kernel",
                 "moe_chunk_plan_fwd_kernel", "moe_chunk_scatter_fwd_kernel", "moe_gemm1_fwd_kernel",
                 "moe_gemm2_fwd_kernel", "moe_combine_fwd_kernel"):
        monkeypatch.setattr(kernels, name, _Recorder(getattr(kernels, name), log))
    monkeypatch.setattr(kernels, "_tma_rows_ok", lambda *ts: False)
    d, E, k, L, I = (shape[n] for n in ("d", "E", "top_k", "L", "I"))
    meta = dict(device="meta", dtype=dtype)
    kernels.moe_routed_fwd(torch.empty(N, d, **meta), torch.empty(N, L, **meta), torch.empty(E, d, **meta),
                           torch.empty(E, device="meta"), torch.empty(E, I, L, **meta), torch.empty(E, I, L, **meta),
                           torch.empty(E, L, I, **meta), k, True, 2.5,
                           tiles=trt.chain_tiles(N, k, dtype, E, tiles), **SITU)
    return log


_PREFILL_CASES = [(257, K3, torch.bfloat16, t) for t in ("m64", "m128t64", "m64t32-n128")] + [
    (4096, K3, torch.bfloat16, None), (1100, TINY, torch.float16, None), (1100, TINY, torch.float32, None)]


@pytest.mark.parametrize("N,shape,dtype,tiles", [(1, K3, torch.bfloat16, None), (5, K3, torch.bfloat16, None),
                                                 (64, K3, torch.bfloat16, None), (65, K3, torch.bfloat16, None),
                                                 (256, K3, torch.bfloat16, None), (1, TINY, torch.float16, None),
                                                 (5, TINY, torch.float32, None), (20, TINY, torch.float16, None),
                                                 *_PREFILL_CASES])
def test_contract_equals_torch_launcher(N, shape, dtype, tiles, monkeypatch):
    """Grid, num_warps/num_stages, every scalar and constant, and every tensor's numel and dtype equal what
    `moe_routed_fwd` passes to the same kernels for the same shapes and tiling (the wrappers only reorder them):
    the decode chain up to 4096 pairs, the prefill chain (each of its tilings) beyond."""
    from k3export.plugins.moe import trt
    tiles = trt.PREFILL_TILINGS[tiles] if tiles else None
    log = _torch_launches(N, shape, dtype, monkeypatch, tiles)
    steps = _steps(N, shape, dtype, scaling=2.5, tiles=tiles, **SITU)
    d, E, k, L, I = (shape[n] for n in ("d", "E", "top_k", "L", "I"))
    assert len(log) == len(steps) == (6 if N * k <= 4096 else 8)
    chain = {n: (s, dt) for n, (s, dt) in trt.chain_intermediates(N, E, k, L, I, dtype, tiles=tiles).items()}
    chain.update(x=((N, d), dtype), gate_weight=((E, d), dtype), bias=((E,), torch.float32), z=((N, L), dtype),
                 w1=((E, I, L), dtype), w3=((E, I, L), dtype), w2=((E, L, I), dtype), u=((N, L), dtype))
    for launch, step in zip(log, steps):
        check_launch(launch, step, chain, _TENSOR_NAMES)


def check_launch(launch, step, chain: dict, tensor_names: dict) -> None:
    """One recorded launch (kernel name, grid, arguments by name, options) against its contract `step`: grid,
    warps / stages, every scalar and constant, each tensor's numel and dtype as `chain` (name -> (shape, dtype))
    declares it (`tensor_names`: kernel param -> chain name, per kernel, where they differ)."""
    kname, grid, args, opts = launch
    assert step.grid == grid + (1,) * (3 - len(grid)), (kname, step.grid, grid)
    assert step.num_warps == opts["num_warps"] and step.num_stages == opts.get("num_stages", 3), kname
    mine = {**step.scalars, **step.constexprs}
    for name, value in args.items():
        if isinstance(value, torch.Tensor):
            if kname == "moe_topk_fwd_kernel" and step.constexprs["SPLITS"] == 1 and name == "s":
                name = "part"                      # unsplit router: s and part are the same tensor
            shp, dt = chain[tensor_names.get(kname, {}).get(name, name)]
            assert value.numel() == torch.Size(shp).numel() and value.dtype == dt, (kname, name)
        else:
            assert mine[name] == value, (kname, name, mine[name], value)
    assert set(mine) >= {n for n, v in args.items() if not isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("shape,dtype,max_tokens", [(K3, torch.bfloat16, 64), (K3, torch.bfloat16, 256),
                                                   (TINY, torch.float16, 20), (K3, torch.bfloat16, 16384),
                                                   (TINY, torch.float16, 1100), (TINY, torch.float32, 1100)])
def test_grids_and_intermediates_are_shape_expressions(shape, dtype, max_tokens):
    """With N symbolic (only + - * // and min), grids, scalars and intermediate shapes still build, and evaluate
    for each N <= max_tokens to the ints of the int-N contract compiled for the same max_tokens: they depend on
    the shapes alone, never on routing; the compiled constants do not depend on N at all."""
    from k3export.plugins.moe import trt
    N = _Sym(lambda n: n)
    d, E, k, L, I = (shape[n] for n in ("d", "E", "top_k", "L", "I"))
    sym = _steps(N, shape, dtype, max_tokens=max_tokens, minimum=_sym_min)
    sym_inter = trt.chain_intermediates(N, E, k, L, I, dtype, max_tokens, _sym_min)
    for n in sorted({1, 3, min(70, max_tokens), max_tokens}):
        ref = _steps(n, shape, dtype, max_tokens=max_tokens)
        for s, r in zip(sym, ref):
            assert tuple(_ev(g, n) for g in s.grid) == r.grid and s.constexprs == r.constexprs
            assert {a: _ev(v, n) for a, v in s.scalars.items()} == r.scalars and s.params == r.params
        ref_inter = trt.chain_intermediates(n, E, k, L, I, dtype, max_tokens)
        assert {a: (tuple(_ev(x, n) for x in shp), dt) for a, (shp, dt) in sym_inter.items()} == ref_inter


def test_chain_choice_and_refusals():
    """The chain follows max_tokens k (not N): up to 4096 pairs the decode chain, beyond the prefill one, which
    `decode_steps` refuses by name; a symbolic N needs max_tokens; a TMA or chunk-less tiling is refused."""
    from dataclasses import replace

    from k3export.plugins.moe import trt
    assert [s.plugin for s in _steps(256, K3, torch.bfloat16)] == DECODE_CHAIN
    assert [s.plugin for s in _steps(257, K3, torch.bfloat16)] == PREFILL_CHAIN           # 4112 pairs
    assert [s.plugin for s in _steps(1, K3, torch.bfloat16, max_tokens=257)] == PREFILL_CHAIN
    E, k = K3["E"], K3["top_k"]                           # the prefill tiling by rows per expert at max_tokens
    assert trt.chain_tiles(4096, k, torch.bfloat16, E) is trt.PREFILL_TILINGS["m64t32-n128"]       # 73 rows
    assert trt.chain_tiles(8192, k, torch.bfloat16, E) is trt.PREFILL_TILINGS["m128t64"]           # 146 rows
    assert trt.chain_tiles(8192, k, torch.float16, E).block_m == 128 and trt.chain_tiles(
        8192, k, torch.float32, E).chunk_align == 1024
    with pytest.raises(ValueError, match="prefill chain"):
        trt.decode_steps(257, *K3.values(), torch.bfloat16)
    with pytest.raises(ValueError, match="max_tokens"):
        _steps(_Sym(lambda n: n), K3, torch.bfloat16)
    with pytest.raises(ValueError, match="pointer-load"):
        _steps(300, K3, torch.bfloat16, tiles=replace(trt.PREFILL_TILINGS["m64"], tma="w"))
    with pytest.raises(ValueError, match="chunked align"):
        _steps(300, K3, torch.bfloat16, tiles=replace(trt.PREFILL_TILINGS["m64"], chunk_align=0))


def test_tensorrt_plugins():
    pytest.importorskip("tensorrt", reason=TRT_SKIP)
    from k3export.plugins.moe import trt
    assert trt.register_plugins()


@pytest.mark.parametrize("max_tokens", [20, 1100])
def test_plugin_registration_against_a_stand_in(monkeypatch, max_tokens):
    """`register_plugins` on the stand-in above, then a build of the chain on a symbolic N: each plugin's output
    descriptors feed the next; evaluated at N = 1 and max_tokens, every output shape/dtype, grid, block, shared
    memory, kernel name/PTX and extra argument equals the int contract (`chain_steps` for that N). max_tokens 20:
    the decode chain (80 pairs); 1100: the prefill chain (4400 pairs)."""
    from k3export.plugins.moe import trt as moe_trt
    fake_trt, trtp = install(monkeypatch)
    assert moe_trt.register_plugins()
    assert set(trtp.aot) == set(trtp.registered) == set(DECODE_CHAIN + PREFILL_CHAIN)

    d, E, k, L, I = (TINY[n] for n in ("d", "E", "top_k", "L", "I"))
    N = _Sym(lambda n: n)
    attrs = dict(max_tokens=max_tokens, top_k=k, renormalize=True, scaling=2.5, num_experts=E,
                 block_rows=moe_trt.chain_tiles(max_tokens, k, torch.float16, E).rows, **SITU)
    T = trtp.TensorDesc
    f16, f32 = fake_trt.float16, fake_trt.float32
    descs = dict(x=T((N, d), f16), gate_weight=T((E, d), f16), bias=T((E,), f32), z=T((N, L), f16),
                 w1=T((E, I, L), f16), w3=T((E, I, L), f16), w2=T((E, L, I), f16))
    built = build_on_stand_in(trtp, _steps(1, TINY, torch.float16, max_tokens=max_tokens), descs, attrs)
    dtypes = {torch.float16: f16, torch.float32: f32, torch.int32: fake_trt.int32}
    for n in (1, max_tokens):
        inter = moe_trt.chain_intermediates(n, E, k, L, I, torch.float16, max_tokens)
        inter["u"] = ((n, L), torch.float16)
        check_built(built, _steps(n, TINY, torch.float16, max_tokens=max_tokens, scaling=2.5, **SITU), inter, n,
                    dtypes)


def build_on_stand_in(trtp, steps, descs: dict, attrs: dict) -> dict:
    """The chain built on the stand-in: each step's registered descriptor function (its outputs feed the next) and
    aot_impl, with the attributes each takes; plugin -> (aot_impl's result, output descriptors)."""
    built = {}
    for step in steps:
        fn, tensors, attr_names, n_out = trtp.registered[step.plugin]
        assert tensors == list(step.inputs), step.plugin
        ins = [descs[t] for t in tensors]
        outs = fn(*ins, **{a: attrs[a] for a in attr_names})
        assert len(outs) == n_out == len(step.outputs), step.plugin
        descs.update(zip(step.outputs, outs))
        aot_fn = trtp.aot[step.plugin]
        used = [a for a in attr_names if a in aot_fn.__code__.co_varnames]
        built[step.plugin] = (aot_fn(*ins, **{a: attrs[a] for a in used}, outputs=outs, tactic=0), outs)
    return built


def check_built(built: dict, steps, inter: dict, n: int, dtypes: dict) -> None:
    """At N = n, every plugin's kernel name / PTX, grid, block, shared memory, extra arguments and output shapes /
    dtypes equal the int contract `steps` (`inter`: name -> (shape, dtype) of the outputs at n)."""
    for step in steps:
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
def _run_chain(steps, tensors: dict, max_tokens, launch, tiles=None) -> torch.Tensor:
    from k3export.plugins.moe import trt
    N, L = tensors["z"].shape
    E, I = tensors["w1"].shape[:2]
    inter = trt.chain_intermediates(N, E, steps[1].constexprs["K"], L, I, tensors["z"].dtype, max_tokens,
                                    tiles=tiles)
    return run_chain(steps, tensors, inter, launch)


def run_chain(steps, tensors: dict, inter: dict, launch) -> torch.Tensor:
    """Allocate the intermediates `inter` (as the contract declares them, uninitialised) and u, run the steps with
    `launch(step, tensors bound to its pointer params)`, return u."""
    from k3export.plugins.moe import trt
    N, L = tensors["z"].shape
    dev, dtype = tensors["z"].device, tensors["z"].dtype
    bufs = {n: torch.empty(shp, device=dev, dtype=dt) for n, (shp, dt) in inter.items()}
    bufs["u"] = torch.empty(N, L, device=dev, dtype=dtype)
    for step in steps:
        launch(step, trt.bind(step, {**tensors, **bufs}))
    return bufs["u"]


def _interpret(step, tensors):
    step.fn[step.grid](**tensors, **step.scalars, **step.constexprs, num_warps=step.num_warps,
                       num_stages=step.num_stages)


def _interpreter_cases() -> dict:
    from dataclasses import replace

    from k3export.plugins.moe import trt
    from k3export.plugins.moe.kernels import ALIGN_FUSED_MAX, moe_routed_fwd
    res = {}
    s = TINY
    for name, dt in {"fp32": torch.float32, "fp16": torch.float16}.items():
        # Decode chain: PTX for 80 tokens run on 5. Prefill chain ("pn": the chain switch lowered from 4096 to 64
        # pairs, so the chain runs at sizes the interpreter takes in seconds; chunks of 32 pairs): 40 tokens
        # (160 pairs, 5 chunks), and PTX for 40 run on 23 (92 pairs).
        for N, max_tokens, pre in ((1, None, 0), (5, 80, 0), (20, None, 0), (40, None, 1), (23, 40, 1)):
            trt.ALIGN_FUSED_MAX = 64 if pre else ALIGN_FUSED_MAX
            tiles = replace(trt.chain_tiles(max_tokens or N, s["top_k"], dt, s["E"]), chunk_align=32) if pre else None
            torch.manual_seed(N)
            x, z = torch.randn(N, s["d"], dtype=dt), torch.randn(N, s["L"], dtype=dt)
            g = torch.randn(s["E"], s["d"], dtype=dt) * s["d"] ** -0.5
            b = torch.randn(s["E"]) * 0.1
            w1 = torch.randn(s["E"], s["I"], s["L"], dtype=dt) * s["L"] ** -0.5
            w3 = torch.randn(s["E"], s["I"], s["L"], dtype=dt) * s["L"] ** -0.5
            w2 = torch.randn(s["E"], s["L"], s["I"], dtype=dt) * s["I"] ** -0.5
            steps = _steps(N, s, dt, scaling=2.5, max_tokens=max_tokens, tiles=tiles, **SITU)
            u = _run_chain(steps, dict(x=x, gate_weight=g, bias=b, z=z, w1=w1, w3=w3, w2=w2), max_tokens,
                           _interpret, tiles)
            op = moe_routed_fwd(x, z, g, b, w1, w3, w2, s["top_k"], True, 2.5, tiles=tiles or decode_tiles(dt),
                                **SITU)
            ref = moe_sorted(x.double(), z.double(), g.double(), b, w1.double(), w3.double(), w2.double(),
                             s["top_k"], True, 2.5, **SITU)
            case = f"{name}-{'p' if pre else ''}n{N}-max{max_tokens or N}"
            res[f"ref-{case}"] = _rel(u, ref)
            res[f"op-{case}"] = _rel(u, op)
    trt.ALIGN_FUSED_MAX = ALIGN_FUSED_MAX
    return res


_INTERP = [f"{n}-{N}-max{m}" for n in ("fp32", "fp16") for N, m in (("n1", 1), ("n5", 80), ("n20", 20), ("pn40", 40),
                                                                    ("pn23", 40))]


@pytest.mark.parametrize("case", _INTERP)
def test_interpreted_chain_vs_reference(interp, case):
    assert interp[f"ref-{case}"] < (FP32_BOUND if case.startswith("fp32") else FP16_BOUND), interp


@pytest.mark.parametrize("case", [c for c in _INTERP if c.split("n", 1)[1].split("-max")[0] == c.split("-max")[1]])
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


def clear_token_errors(u, op, ref, x, gate_weight, bias, k: int):
    """(mask of the tokens whose top-k is clear of a near-tie, relative max error of u vs op and vs ref on them):
    a near-tie at the top-k boundary lets a reordered fp32 router sum pick another expert, legitimately."""
    top = torch.topk(torch.sigmoid(x.float() @ gate_weight.float().T) + bias, k + 1, dim=-1).values
    clear = (top[:, k - 1] - top[:, k]) > 1e-5
    assert clear.any(), "every token has a near-tie on this draw"
    err = [((u.double() - r.double())[clear].abs().max() / r.double().abs().max()).item() for r in (op, ref)]
    return clear, err[0], err[1]


@pytest.mark.cuda
@pytest.mark.parametrize("N,max_tokens", [(1, None), (64, None), (5, 256), (4096, None), (300, 16384)])
def test_chain_through_cupy_k3(k3_weights, N, max_tokens):
    """The PTX launches through the CUDA driver at K3 size vs the op's row-plan path on the chain's tiling and
    moe_sorted on fresh random inputs, on the tokens whose top-16 selection is clear (a near-tie at the boundary
    may pick another expert under other rounding). (5, 256): PTX compiled for 256 tokens, run on 5 (a
    dynamic-shape engine). 4096 and (300, 16384): the prefill chain (chunked align, pointer-load prefill tiles)."""
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
    from k3export.plugins.moe import trt
    from k3export.plugins.moe.kernels import moe_routed_fwd
    op = moe_routed_fwd(*args[:7], *args[7:10], beta=args[10], linear_beta=args[11],
                        tiles=trt.chain_tiles(max_tokens or N, k, x.dtype, K3["E"]))
    ref = moe_sorted(*args)
    clear, err_op, err_ref = clear_token_errors(u, op, ref, x, wt["gate_weight"], wt["bias"], k)
    print(f"moe trt chain N={N} max_tokens={max_tokens}: vs op {err_op:.2e}, vs moe_sorted {err_ref:.2e} on "
          f"{int(clear.sum())}/{N} clear tokens")
    assert u.shape == z.shape and err_op < CHAIN_BOUND and err_ref < BF16_BOUND


if __name__ == "__main__":
    print(json.dumps(_interpreter_cases()))
