"""Projection packing (`k3export.model.packing`): one GEMM for the linears that share an input, checkpoint names
and values unchanged, the same outputs as the model as written."""

import pytest
import torch
from torch import nn

from k3export.config import K3Config
from k3export.model.packing import pack_projections, packed_count, unpack_projections, unpacked
from k3export.model.weights import random_model

CFG = K3Config.from_name("k3-tiny")
# fp32 on the CPU, relative error of each output of a step against the model as written. Decode: row packing was
# exact there in most runs (0 at one token per sequence); the column-packed MoE output is one sum instead of two
# added: measured 1e-7..4.4e-6 over 3 weight and 12 state seeds. Prefill: CPU BLAS blocks a 14-row GEMM
# differently when N grows, so the row-packed sums run in another order too, and the random model amplifies it:
# measured 3e-6..4.7e-5.
DECODE_REL, PREFILL_REL = 1e-5, 1e-4


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _state(model, B=2, L=16):
    st, g = model.new_state(B, L), torch.Generator().manual_seed(1)
    return (st.kda_conv.normal_(generator=g), st.kda_state.normal_(std=0.1, generator=g),
            st.mla_cache.normal_(generator=g))


def _decode(model, ids, state, cache_len):
    return model.forward_decode(ids, *state, cache_len)


def test_packed_model_matches_the_model_as_written():
    m = random_model(CFG, seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (2, 7), generator=g)
    lengths, cache_len = torch.tensor([7, 4]), torch.tensor([5, 9])
    conv, st, cache = _state(m)
    ref_pre = m.forward_prefill(ids, lengths, conv, st, cache, cache_len)
    ref_dec = _decode(m, ids[:, 0], (conv, st, cache), cache_len)
    keys = {k: v.clone() for k, v in m.state_dict().items()}
    n_params = len(list(m.parameters()))

    # one GEMM per KDA / MLA layer and per dense MLP, two per MoE with shared experts (rows + columns), and
    # KDA's conv kernels
    n_dense = sum(CFG.is_dense(i) for i in range(CFG.num_hidden_layers))
    n_moe = (CFG.num_hidden_layers - n_dense) if CFG.num_shared_experts else 0
    n = pack_projections(m)
    assert n == CFG.num_hidden_layers + len(CFG.kda_layers) + n_dense + 2 * n_moe == packed_count(m)
    got_pre = m.forward_prefill(ids, lengths, conv, st, cache, cache_len)
    got_dec = _decode(m, ids[:, 0], (conv, st, cache), cache_len)
    err_pre, err_dec = [rel(a, b) for a, b in zip(got_pre, ref_pre)], [rel(a, b) for a, b in zip(got_dec, ref_dec)]
    assert max(err_pre) < PREFILL_REL and max(err_dec) < DECODE_REL, (err_pre, err_dec)
    # the checkpoint view of the model is unchanged: same names, same values, no extra parameter
    sd = m.state_dict()
    assert sd.keys() == keys.keys() and all(torch.equal(sd[k], keys[k]) for k in keys)
    assert len(list(m.parameters())) == n_params
    # and each member's weight is a view into its packed GEMM's weight (no second copy)
    kda = m.model.layers[0].self_attn if not CFG.is_mla(0) else m.model.layers[1].self_attn
    packed_w = kda.project.linear.weight
    assert kda.q_proj.weight.untyped_storage().data_ptr() == packed_w.untyped_storage().data_ptr()
    assert kda.v_conv1d.weight.untyped_storage().data_ptr() == kda.conv_weight().untyped_storage().data_ptr()

    assert unpack_projections(m) == n and packed_count(m) == 0
    again = _decode(m, ids[:, 0], (conv, st, cache), cache_len)
    # the as-written path again, now on the views: same values, though CPU BLAS may sum a view at another
    # alignment in another order (seen once in ~10 runs), hence the decode bound rather than bit equality
    assert max(rel(a, b) for a, b in zip(again, ref_dec)) < DECODE_REL


def test_loading_weights_into_a_packed_model_reaches_the_packed_gemms():
    """The members are views, so `load_state_dict` (in-place copies) updates what the packed GEMMs read."""
    m, other = random_model(CFG, seed=3), random_model(CFG, seed=4)
    pack_projections(m)
    m.load_state_dict(other.state_dict())
    ids = torch.randint(0, CFG.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    assert rel(m(ids), other(ids)) < PREFILL_REL


def test_moving_or_casting_a_packed_model_unpacks_it():
    m = random_model(CFG, seed=3)
    pack_projections(m)
    m.to(torch.float64)                      # each weight copied on its own: a packed GEMM would keep fp32 ones
    assert packed_count(m) == 0 and m.dtype == torch.float64
    ids = torch.randint(0, CFG.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    assert m(ids).dtype == torch.float64


def test_unpacked_block_restores_packing_and_export_sees_the_model_as_written(tmp_path):
    from k3export.export import ExportLimits, export_graphs
    from k3export.model.packing import fuse_norms
    m = random_model(CFG, seed=3)
    n = pack_projections(m) + fuse_norms(m)
    with unpacked(m):
        assert packed_count(m) == 0
    assert packed_count(m) == n
    export_graphs(m, tmp_path / "g", ExportLimits(max_batch=2, max_tokens=16, max_cache=32), log=lambda s: None)
    assert packed_count(m) == n
    decode = torch.export.load(tmp_path / "g" / "decode.pt2")
    names = set(decode.state_dict) | set(decode.constants)
    assert not any(".project." in k or ".output." in k for k in names)       # no packed tensor was captured
    assert any(k.endswith("q_proj.weight") for k in names)
    ops = {str(nd.target) for nd in decode.graph_module.graph.nodes if nd.op == "call_function"}
    assert any("k3.attn_res." in o for o in ops) and not any("attn_res_norm" in o or "attn_res_add_norm" in o
                                                              for o in ops)


def test_fp8_linears_pack_only_with_one_input_scale():
    from k3export.fp8 import FP8Linear
    from k3export.model.packing import _pack_rows
    g = torch.Generator().manual_seed(0)
    lins = [nn.Linear(64, n, bias=False) for n in (32, 48, 16)]
    for lin in lins:
        lin.weight.data = torch.randn(lin.weight.shape, generator=g)
    s_in = torch.tensor(0.02)
    q = [FP8Linear.from_linear(lin, s_in, lin.weight.abs().amax(1) / 448) for lin in lins]
    x = torch.randn(5, 64, generator=g)
    ref = [m(x) for m in q]
    packed = _pack_rows(q)
    assert packed is not None
    assert all(torch.equal(a, b) for a, b in zip(packed(x), ref))      # per-row scales: the same products
    assert q[1].qweight.untyped_storage().data_ptr() == packed.linear.qweight.untyped_storage().data_ptr()
    other = [FP8Linear.from_linear(lin, s, lin.weight.abs().amax(1) / 448)
             for lin, s in zip(lins, (s_in, s_in * 2, s_in))]
    assert _pack_rows(other) is None                                      # two input scales: no shared GEMM
    assert _pack_rows([q[0], lins[1]], merge=[2]) is None                 # one output across two kinds
    assert _pack_rows([lins[0], nn.Linear(64, 8, bias=False).double()]) is None    # cat would promote
    mixed = [FP8Linear.from_linear(lins[0], s_in, lins[0].weight.abs().amax(1) / 448), lins[1], lins[2]]
    ref = [m(x) for m in mixed]
    runs = _pack_rows(mixed)                              # an FP8 run, then a bf16/fp32 run: two GEMMs
    assert len(runs.parts) == 2 and all(torch.equal(a, b) for a, b in zip(runs(x), ref))


def test_quantize_model_unpacks_first():
    from k3export.fp8 import quantize_model
    m = random_model(CFG, seed=3)
    pack_projections(m)
    name = "model.layers.1.self_attn.q_proj" if not CFG.is_mla(1) else "model.layers.0.self_attn.q_proj"
    w = m.get_submodule(name).weight
    scales = {f"{name}.input_scale": torch.tensor(0.05), f"{name}.weight_scale": w.abs().amax(1) / 448}
    quantize_model(m, scales)
    assert packed_count(m) == 0           # else the packed GEMM would go on reading the bf16 q_proj weights


def test_compile_backend_packs():
    from k3export.runtime import CompileBackend
    m = random_model(CFG, seed=3)
    backend = CompileBackend(m)
    assert backend.packed > 0 and backend.fused == 2 and packed_count(m) == backend.packed + 2


@pytest.mark.cuda
def test_packed_modules_on_the_gpu_match_the_modules_as_written():
    """k3-small bf16 on the GPU, every k3 op on its kernel, one module at a time (a whole random model amplifies
    any rounding difference). Row-packed GEMMs: the same dot products, bound 1e-6 (cuBLAS may pick another
    kernel); the column-packed MoE output rounds once instead of twice: bf16 rounding, bound 1e-2."""
    from k3export.runtime import load_kernels
    load_kernels("cuda")
    cfg = K3Config.from_name("k3-small")
    m = random_model(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, L = 4, 64
    x = torch.randn(B, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    st = m.new_state(B, L)
    conv, state, cache = st.kda_conv.normal_(), st.kda_state.normal_(std=0.1), st.mla_cache.normal_()
    cache_len = torch.tensor([0, 1, 17, 63], device="cuda")
    kda = m.model.layers[cfg.kda_layers[0]].self_attn
    mla = m.model.layers[cfg.mla_layers[0]].self_attn
    moe = m.model.layers[1].block_sparse_moe
    dense = m.model.layers[0].mlp
    calls = {"kda": lambda: kda.decode(x, conv[0], state[0]), "mla": lambda: mla.decode(x, cache[0], cache_len),
             "moe": lambda: (moe(x),), "dense": lambda: (dense(x),)}
    ref = {k: f() for k, f in calls.items()}
    pack_projections(m)
    for k, f in calls.items():
        bound = 1e-2 if k == "moe" else 1e-6
        errs = [rel(a, b) for a, b in zip(f(), ref[k])]
        assert max(errs) <= bound, (k, errs)


def test_fp8_model_packs_by_kind_and_matches_unpacked():
    """k3-tiny calibrated with the default recipe (KDA's f_a / b stay bf16-class by recipe): its KDA group packs
    as two GEMMs (FP8 q|k|v|g, then f_a|b), with `fp8_cols` each MoE's FP8 output pair becomes `Fp8Cols` (on CPU
    its two linears and the add, as written), and a decode step equals the unpacked one up to summation order."""
    from k3export.calibrate import DEFAULT_RECIPE, Recipe, calibrate, default_batches
    from k3export.fp8 import quantize_model
    from k3export.model.packing import PackedRuns
    m = random_model(CFG, seed=0)
    quantize_model(m, calibrate(m, Recipe.load(DEFAULT_RECIPE), default_batches(CFG.vocab_size, 2, 8, 2),
                                progress=False))
    ids, cache_len = torch.tensor([5, 9]), torch.tensor([3, 11])
    state = _state(m)
    ref = _decode(m, ids, state, cache_len)
    assert pack_projections(m, fp8_cols=True) > 0
    kda = m.model.layers[CFG.kda_layers[0]].self_attn
    assert isinstance(kda.project, PackedRuns) and len(kda.project.parts) == 2
    from k3export.fp8 import FP8Linear
    from k3export.model.moe import LatentMoE
    from k3export.model.packing import Fp8Cols
    moes = [mod for mod in m.modules() if isinstance(mod, LatentMoE) and mod.shared_experts is not None
            and isinstance(mod.routed_expert_up_proj, FP8Linear)
            and isinstance(mod.shared_experts.down_proj, FP8Linear)]
    assert moes and all(isinstance(mod.__dict__.get("output"), Fp8Cols) for mod in moes)     # the FP8 output pair
    got = _decode(m, ids, state, cache_len)
    assert max(rel(a, b) for a, b in zip(got, ref)) < DECODE_REL


def test_fused_mix_norm_is_the_model_as_written_on_cpu():
    """`fuse_norms`: each AttnRes mix + the RMSNorm after it as one `k3::attn_res_norm` call, and with the residual
    add before them as one `k3::attn_res_add_norm` call. Their CPU implementations are the same torch ops as the
    unfused path, so the step is bit-identical here (the kernel's own bounds are in
    tests/test_attn_res_kernels.py). They survive packing, `unpacked` puts them back, and the exported graphs
    never carry them."""
    from k3export.model.packing import fuse_norms
    from k3export.runtime import CompileBackend
    m = random_model(CFG, seed=3)
    ids, cache_len = torch.tensor([5, 9]), torch.tensor([3, 11])
    state = _state(m)
    ref = _decode(m, ids, state, cache_len)
    assert fuse_norms(m, adds=False) == 1 and packed_count(m) == 1
    got = _decode(m, ids, state, cache_len)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert fuse_norms(m) == 2 and packed_count(m) == 2
    got = _decode(m, ids, state, cache_len)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    n = pack_projections(m)
    assert packed_count(m) == n + 2                    # packing leaves the fused norms on
    with unpacked(m):
        assert packed_count(m) == 0
    assert packed_count(m) == n + 2
    backend = CompileBackend(m, fuse_norms=False)      # asks for packing only: the fused norms go
    assert (backend.packed, backend.fused) == (n, 0) and packed_count(m) == n
    assert CompileBackend(m, fuse_adds=False).fused == 1 and packed_count(m) == n + 1
    assert CompileBackend(m).fused == 2 and packed_count(m) == n + 2          # the default fuses both


def test_paired_experts_keep_names_values_and_outputs():
    """pair_experts: w1 / w3 become the even / odd rows of one tensor (the MoE prefill kernel's one-tile layout);
    names, values and parameter count unchanged, outputs within the packing bounds (the CPU reference reads the
    strided views), load_state_dict writes into the pair, a cast or unpair_experts gives contiguous weights."""
    from k3export.model.moe import ExpertBank
    from k3export.model.packing import pair_experts, unpair_experts
    from k3export.plugins.moe.kernels import paired_gate_up
    m, other = random_model(CFG, seed=3), random_model(CFG, seed=4)
    ids = torch.randint(0, CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    ref, keys = m(ids), {k: v.clone() for k, v in m.state_dict().items()}
    banks = [b for b in m.modules() if isinstance(b, ExpertBank)]
    n_params = len(list(m.parameters()))
    assert pair_experts(m) == len(banks) > 0 and pair_experts(m) == len(banks)          # idempotent
    assert all(paired_gate_up(b.w1, b.w3) is not None for b in banks)
    sd = m.state_dict()
    assert sd.keys() == keys.keys() and all(torch.equal(sd[k], keys[k]) for k in keys)
    assert len(list(m.parameters())) == n_params
    assert rel(m(ids), ref) < PREFILL_REL
    m.load_state_dict(other.state_dict())
    assert all(paired_gate_up(b.w1, b.w3) is not None for b in banks) and rel(m(ids), other(ids)) < PREFILL_REL
    assert unpair_experts(m) == len(banks) and all(b.w1.is_contiguous() and b.w3.is_contiguous() for b in banks)
    assert rel(m(ids), other(ids)) < PREFILL_REL
    pair_experts(m)
    m.to(torch.float64)
    assert all(paired_gate_up(b.w1, b.w3) is None for b in banks)


def test_compile_backend_pairs_experts_only_on_cuda():
    """On the CPU the reference reads the experts (no kernel to gain): the backend leaves them, and unpairs a
    model that an earlier CUDA backend or a user paired."""
    from k3export.model.moe import ExpertBank
    from k3export.model.packing import pair_experts
    from k3export.plugins.moe.kernels import paired_gate_up
    from k3export.runtime import CompileBackend
    m = random_model(CFG, seed=3)
    pair_experts(m)
    b = CompileBackend(m)
    assert b.paired == 0 and not any(paired_gate_up(e.w1, e.w3) is not None for e in m.modules()
                                     if isinstance(e, ExpertBank))


@pytest.mark.cuda
def test_compiled_prefill_reads_paired_experts(monkeypatch):
    """On the GPU the compile backend pairs the experts, and the compiled graph hands the op the paired views (no
    copy to contiguous on the way), at k3-small prefill (2048 tokens: 256 rows per expert, the paired gemm1). One
    MoE layer on the same 2048 rows, paired vs separate weights: each layout runs its own default tiling
    (m128t64-aw-y16r-f2 / m128-tma-aw), so the bf16 roundings of h and of the expert outputs differ: bound 1e-2
    (the kernel tests' tiling-vs-tiling differences are ~5e-3). Whole-model logits are not compared: through 12
    random layers such rounding differences grow to O(1) (docs/perf.md, FP8 report's noise floor)."""
    from k3export.model.packing import pair_experts, unpair_experts
    from k3export.plugins.moe import kernels as K
    from k3export.runtime import CompileBackend, load_kernels
    load_kernels("cuda")
    cfg = K3Config.from_name("k3-small")
    m = random_model(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    moe = m.model.layers[1].block_sparse_moe
    x = torch.randn(2048, cfg.hidden_size, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator("cuda").manual_seed(1))
    ref = moe(x)
    pair_experts(m)
    err = rel(moe(x), ref)
    unpair_experts(m)
    ids = torch.randint(0, cfg.vocab_size, (1, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    st = m.new_state(1, 2048)
    args = (ids, torch.tensor([2048], device="cuda"), st.kda_conv, st.kda_state, st.mla_cache,
            torch.zeros(1, dtype=torch.long, device="cuda"))
    b = CompileBackend(m)                                       # pairs the experts here
    seen = []
    real = K.paired_gate_up
    monkeypatch.setattr(K, "paired_gate_up", lambda w1, w3: seen.append(real(w1, w3) is not None) or real(w1, w3))
    b.prefill(*args)
    print(f"paired banks {b.paired}; op-side layout checks seeing the pair {sum(seen)}/{len(seen)}; one MoE layer "
          f"paired vs separate {err:.2e}")
    assert b.paired == cfg.num_hidden_layers - sum(cfg.is_dense(i) for i in range(cfg.num_hidden_layers))
    assert seen and all(seen) and err < 1e-2
