"""Milestone 2, first part (scripts/megakernel_layer.py): the model's MoE sublayers as phases of the persistent
kernel. On the CPU: the chain from the model's weights, its torch emulation (the kernel's arithmetic) against an
fp64 evaluation of the spec, the x recipes and their checks; on the GPU (cuda): the kernel against the emulation
and against the `compile` backend's MoE."""

from __future__ import annotations

import dataclasses
import math
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch

from k3export.megakernel import chain as mc  # noqa: E402
from k3export.megakernel import layer as ml  # noqa: E402

from k3export.config import K3Config, PRESETS  # noqa: E402
from k3export.plugins.moe.naive import situ_glu  # noqa: E402


def _needs_the_kernel():
    """Skip unless chain.cu can run here: an NVIDIA GPU of compute capability 9.0 and cupy."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU; run `make test-gpu` on the GPU machine")
    pytest.importorskip("cupy", reason="the chain kernel launches through cupy")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("sm_90a kernel")


@pytest.fixture(scope="module")
def tiny():
    from k3export.model.weights import random_model
    cfg = K3Config.from_name("k3-tiny")
    return cfg, random_model(cfg, seed=0, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def tiny128():
    """k3-tiny with KDA heads of 128 (the head dim chain.cu's KDA phase is written for), two of them."""
    from k3export.model.weights import random_model
    base = K3Config.from_name("k3-tiny")
    cfg = dataclasses.replace(base, linear_attn_config=dataclasses.replace(base.linear_attn_config, num_heads=2,
                                                                           head_dim=128))
    return cfg, random_model(cfg, seed=0, dtype=torch.bfloat16)


def _moe_f64(cfg, moe, x):
    """The MoE sublayer of the spec in fp64 from the model's weights (no intermediate rounding); its experts."""
    D = torch.Tensor.double
    x, sh, ex = D(x), moe.shared_experts, moe.experts
    beta, lb = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    z = D(moe.routed_expert_down_proj.weight) @ x
    s = torch.sigmoid(D(moe.gate.weight) @ x)
    top = torch.topk(s + D(moe.gate.e_score_correction_bias), cfg.num_experts_per_token).indices
    w = s[top] / s[top].sum() * cfg.routed_scaling_factor
    comb = sum(wi * (D(ex.w2[e]) @ situ_glu(D(ex.w1[e]) @ z, D(ex.w3[e]) @ z, beta, lb)) for wi, e in zip(w, top))
    nrm = comb * torch.rsqrt((comb ** 2).mean() + cfg.rms_norm_eps) * D(moe.routed_expert_norm.weight)
    hs = situ_glu(D(sh.gate_proj.weight) @ x, D(sh.up_proj.weight) @ x, beta, lb)
    return D(moe.routed_expert_up_proj.weight) @ nrm + D(sh.down_proj.weight) @ hs, top.tolist()


def _emulated(cfg, model, seed=0, packed_out=False):
    chain = ml.layers_chain(model, ml.moe_layers(cfg), packed_out=packed_out)
    bufs = mc.Buffers(chain, device="cpu")
    bufs.x.copy_(torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).bfloat16().float())
    bufs.clear()
    bufs.run_reference()
    return chain, bufs


def test_moe_chain_has_seven_phases_a_sublayer_with_the_models_weights(tiny):
    cfg, model = tiny
    layers = ml.moe_layers(cfg)
    chain = ml.layers_chain(model, layers)
    assert layers == list(range(1, cfg.num_hidden_layers))
    assert [p.name.split(".", 1)[1] for p in chain.phases[:7]] == [
        "moe.proj", "moe.router", "moe.topk", "moe.shared_down", "moe.gate_up", "moe.down", "moe.up"]
    assert len(chain.phases) == 7 * len(layers) and len(chain.xsegs) == 4 * len(layers)
    d, L, I, E, K = (cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                     cfg.num_experts_per_token)
    Is = I * cfg.num_shared_experts
    proj, router, tk, sd, gu, down, up = chain.phases[7:14]          # layer 2: its x is layer 1's up + shared_down
    assert (proj.n, proj.k, proj.src, proj.dep2, router.src, router.dep2) == (L + 2 * Is, d, 6, 3, 6, 3)
    assert (tk.n, tk.ne, tk.xlen) == (2 * K, K, E)                 # ids, then weights
    assert (sd.n, sd.k) == (d, Is)
    assert (gu.n, gu.k, gu.ne, gu.src, gu.xstride) == (K * 2 * I, L, 2 * I, 7, 0)
    assert (down.n, down.k, down.ne, down.xstride) == (K * L, I, L, 2 * I)
    assert (up.n, up.k) == (d, L)
    moe = model.model.layers[2].block_sparse_moe
    assert torch.equal(chain.init[7][:L], moe.routed_expert_down_proj.weight)
    assert torch.equal(chain.init[11][3, I:], moe.experts.w3[3])
    assert torch.equal(chain.init[10], moe.shared_experts.down_proj.weight)
    glu, comb = chain.xsegs[sd.xop], chain.xsegs[up.xop]
    assert (comb.op, comb.src, comb.route, comb.nslot, comb.stride) == ("combine_norm", 12, 9, K, L)
    assert (glu.op, glu.src, glu.off, glu.off2, glu.round_in) == ("glu", 7, L, Is, True)
    packed = ml.layers_chain(model, layers[:1], packed_out=True)
    assert [p.name for p in packed.phases][-1] == "L1.moe.out" and packed.phases[-1].k == L + Is
    assert torch.equal(packed.init[5][:, L:], model.model.layers[1].block_sparse_moe.shared_experts.down_proj.weight)


def test_emulation_matches_the_spec_in_fp64_as_closely_as_the_model(tiny):
    """Each sublayer of the emulated chain (the kernel's arithmetic, on its own previous output) against the spec in
    fp64 on the same bf16 input: the same experts, and an error no larger than the model's own MoE (bf16 eager)
    has there, within 2e-2 of the largest output (the MoE contract's bf16 bound is ~1e-2; measured on k3-tiny,
    2026-12-02: emulation 2.2e-3..7.0e-3, the model 3.8e-3..7.3e-3)."""
    cfg, model = tiny
    _, bufs = _emulated(cfg, model)
    _, packed = _emulated(cfg, model, packed_out=True)
    assert torch.equal(packed.x, bufs.x)
    assert packed.errors() == {"max_rel": {"gemv": 0.0, "topk": 0.0, "routed": 0.0, "attn": 0.0}, "topk_wrong": [],
                             "unwritten": [], "kda": {}, "kda_out_of_bounds": []}
    worse = 0
    with torch.no_grad():
        for l, x, y, ids in zip(ml.moe_layers(cfg), ml.sublayer_inputs(bufs), ml.outputs(bufs), ml.chosen(bufs)):
            moe = model.model.layers[l].block_sparse_moe
            ref, top = _moe_f64(cfg, moe, x)
            scale = ref.abs().max()
            err = float((y.double() - ref).abs().max() / scale)
            model_err = float((moe(x[None])[0].double() - ref).abs().max() / scale)
            assert ids == top, l
            assert sorted(ids) == sorted(ml.route_ids(moe, x))
            assert err < 2e-2, (l, err)
            worse += err > model_err
    assert worse <= 1


def test_recipe_math_follows_the_triton_helpers():
    """tanh_k3 / situ_glu_k3 (op for op the Triton `_tanh` / SiTU-GLU) against torch in fp64: ~3e-7 relative."""
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(4096, generator=g) * 3, torch.randn(1024, generator=g) * 0.05])
    assert torch.allclose(mc.tanh_k3(x).double(), torch.tanh(x.double()), rtol=1e-6, atol=1e-30)
    a, b = torch.randn(4096, generator=g) * 4, torch.randn(4096, generator=g) * 40
    ref = situ_glu(a.double(), b.double(), 4.0, 25.0)
    assert float(((mc.situ_glu_k3(a, b, 4.0, 25.0).double() - ref).abs() / ref.abs().clamp_min(1e-3)).max()) < 5e-6
    third = float(torch.tensor(1 / 3))                      # fp32 1/3: 3 * third - 1 is not 0, and fma keeps it
    assert mc.fma32(torch.tensor([3.0]), torch.tensor([third]), torch.tensor([-1.0])).item() == pytest.approx(
        3 * third - 1, rel=1e-6) != 0.0


def test_scored_topk_breaks_ties_to_the_lower_id_and_renormalises():
    c = mc.Chain(8)
    r = c.gemv("router", 6, 8, -1)
    bias = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5, -1.0])
    tk = c.topk("topk", 3, r, score=mc.XSeg("score", r, 6, aux=bias, renorm=True, scaling=2.0))
    bufs = mc.Buffers(c, device="cpu")
    bufs.out(r).copy_(torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 9.0]))
    got = bufs.expected(tk)
    s = torch.sigmoid(torch.tensor([0.0, 0.0, 1.0]))                # ids 1, 4 (tie: 1 first), then 2
    assert got[:3].tolist() == [1.0, 4.0, 2.0]
    assert torch.allclose(got[3:], s / s.sum() * 2.0)


def test_recipe_errors_count_the_kernels_differing_x(tiny):
    cfg, model = tiny
    chain, bufs = _emulated(cfg, model)
    for p, ph in enumerate(chain.phases):       # what a check launch would leave: the recipes' own x
        if ph.xop >= 0 and ph.kind != "topk":
            for s in range(cfg.num_experts_per_token if ph.xstride else 1):
                bufs.xdump[p, s, :ph.k] = bufs.recipe_x(p, s).bfloat16()
    bufs.dumped = True
    errs = bufs.recipe_errors()
    assert len(errs) == (cfg.num_experts_per_token + 2) * len(ml.moe_layers(cfg))     # shared_down, down slots, up
    assert all(v["differ"] == 0 for v in errs.values())
    up = next(p for p, ph in enumerate(chain.phases) if ph.name.endswith(".up"))
    bufs.xdump[up, 0, 3] += 1.0
    assert bufs.recipe_errors()["L1.moe.up"]["differ"] == 1


def test_recipes_are_checked_when_the_chain_is_built():
    c = mc.Chain(8)
    g = c.gemv("a", 16, 8, -1)
    t = c.topk("t", 2, g, score=mc.XSeg("score", g, 16, aux=torch.zeros(16)))
    with pytest.raises(ValueError, match="cover 8 of x's 16"):
        c.gemv("b", 4, 16, g, xsegs=[mc.XSeg("glu", g, 8, off2=8)])
    with pytest.raises(ValueError, match="only a top-k's"):
        c.gemv("b", 4, 16, g, xsegs=[mc.XSeg("score", g, 16, aux=torch.zeros(16))])
    with pytest.raises(ValueError, match="not an earlier top-k"):
        c.gemv("b", 4, 16, g, xsegs=[mc.XSeg("combine_norm", g, 16, route=g, nslot=2, aux=torch.ones(16))])
    with pytest.raises(ValueError, match="needs its 16 weights"):
        c.gemv("b", 4, 16, g, xsegs=[mc.XSeg("combine_norm", g, 16, route=t, nslot=2)])
    with pytest.raises(ValueError, match="unknown x recipe op"):
        c.gemv("b", 4, 16, g, xsegs=[mc.XSeg("silu", g, 16)])
    with pytest.raises(ValueError, match="reads words up to 24 of phase 0"):
        c.gemv("b", 4, 16, g, xsegs=[mc.XSeg("glu", g, 16, off2=8)])
    with pytest.raises(ValueError, match="reads words up to 17 of phase 0"):
        c.gemv("b", 4, 16, g, xsegs=[mc.XSeg("combine_norm", g, 16, off=1, route=t, nslot=1, aux=torch.ones(16))])
    with pytest.raises(ValueError, match="weight \\(4, 8\\), the phase needs \\(4, 16\\)"):
        c.gemv("b", 4, 16, g, weight=torch.zeros(4, 8))


def test_xseg_layout_is_chain_cus():
    """64 bytes: aux (int64), op, src, off, len, off2, stride, route, nslot, round_in, renorm (int32), beta, lb, eps,
    scaling (fp32); the kernel's static_asserts hold the C side to the same sizes."""
    raw = mc.XSeg("combine_norm", 3, 1024, off=5, off2=6, stride=7, route=2, nslot=8, round_in=True, renorm=True,
                  beta=4.0, lb=25.0, eps=1e-5, scaling=1.5).packed(0x1234)
    assert len(raw) == mc.XSEG_BYTES == 64
    assert struct.unpack("<q10i4f", raw)[:11] == (0x1234, 2, 3, 5, 1024, 6, 7, 2, 8, 1, 1)
    cu = mc.CU.read_text()
    assert "sizeof(XSeg) == 64" in cu and "sizeof(PhaseC) == 64" in cu and "sizeof(MixAux) == 88" in cu
    assert struct.calcsize(mc.MIX_AUX) == 88 and mc.PHASE_BYTES == 64
    assert all(f"{name} = {v}" in cu for name, v in (("X_GLU", 1), ("X_COMBINE_NORM", 2), ("X_SCORE", 3)))


def test_k3_small_moe_chain_fits_the_kernel():
    """k3-small's 11 MoE sublayers (built on the meta device: shapes only) fit the default ring's shared memory with
    their table and recipes, and chain.cu's row groups; 65.4 MB a sublayer."""
    from k3export.model.k3 import K3Model
    cfg = PRESETS["k3-small"]
    with torch.device("meta"):
        model = K3Model(cfg)
    chain = ml.layers_chain(model, ml.moe_layers(cfg))
    assert len(chain.phases) == 77
    assert mc.smem_bytes(3, 65536, len(chain.phases), len(chain.xsegs)) <= mc.SMEM_LIMIT - 2304
    assert max(mc.row_groups(p, 512, 4) for p in chain.phases if p.kind != "topk") <= mc.GROUPS
    assert chain.bytes_read / 11 == pytest.approx(65.4e6, rel=2e-3)


def test_k3_small_step_with_attnres_fits_the_kernel():
    """k3-small's whole step with AttnRes (MLA stand-ins; meta device) fits the default ring's shared memory with its
    table (64 bytes a phase: at 80 it came 1.8 KB short on the H200, 12-02) and recipes, beside the recipe build's
    2304 bytes of static shared memory; one "attnres" part a mix, shared by its consumers."""
    from k3export.model.k3 import K3Model
    cfg = PRESETS["k3-small"]
    with torch.device("meta"):
        model = K3Model(cfg)
    L = cfg.num_hidden_layers
    chain = ml.layers_chain(model, list(range(L)), kda=True, mla_standins=True, head=True, attnres=True,
                            min_tiles=132)
    # the router's rows and the MLA stand-ins' gate are packed into the sublayer's first GEMV: one AttnRes x load a
    # sublayer (every mix has one consumer)
    assert (len(chain.phases), len(chain.mixes), len(chain.xsegs)) == (148, 2 * L + 1, 91)
    assert not [p for p in chain.phases if p.name.endswith((".router", ".gate"))]
    assert all(p.n == 1024 + 2 * 1536 + 64 for p in chain.phases if p.name.endswith(".moe.proj"))
    consumers = [p for p in chain.phases if p.xop >= 0 and chain.xsegs[p.xop].op == "attnres"]
    assert len(consumers) == len(chain.mixes)
    assert mc.smem_bytes(3, 65536, len(chain.phases), len(chain.xsegs)) <= mc.SMEM_LIMIT - 2304
    assert mc.not_resident(1, 544, 96, mc.smem_bytes(3, 65536, 148, 91), 2304) is None
    assert "static" in mc.not_resident(1, 544, 96, mc.smem_bytes(3, 65536, 148, 91), 5000)
    assert mc.too_wide(chain) == []
    chain.phases[5].src = 40000
    assert mc.too_wide(chain) == [f"{chain.phases[5].name}.src"]


def test_small_phases_spread_over_the_blocks():
    """min_tiles halves a phase's rows (not below 16, the tensor-core tile) while it has fewer tiles than blocks: the
    up projection's 64 tiles become 128 (measured 0.355 -> 0.348 ms on the H200, 12-02); routed_rows caps the routed
    experts' tiles (16: 0.427 ms, slower)."""
    from k3export.model.k3 import K3Model
    with torch.device("meta"):
        model = K3Model(PRESETS["k3-small"])
    rows = lambda c: {p.name.split(".")[-1]: (p.rows, p.ntiles) for p in c.phases}
    plain, spread = rows(ml.layers_chain(model, [1])), rows(ml.layers_chain(model, [1], min_tiles=132))
    assert plain["up"] == (32, 64) and spread["up"] == (16, 128)
    assert spread["router"] == plain["router"] == (16, 4)          # (64 rows: 16 is the floor)
    assert all(spread[k] == plain[k] for k in ("proj", "shared_down", "gate_up", "down"))
    assert rows(ml.layers_chain(model, [1], routed_rows=16))["gate_up"] == (16, 768)
    assert mc.k3_small_chain().ntiles == 23785                     # (the synthetic chains keep their tiles)


def test_compare_counts_bf16_spacings():
    b = torch.tensor([1.0, 2.0, -4.0, 0.5]).bfloat16()
    a = b.float().clone()
    a[1] += 2 * 2 ** -6                                     # two spacings at 2.0 (2^-6)
    r = ml.compare(a.bfloat16(), b)
    assert (r["differ"], r["max_ulps"]) == (1, 2.0)
    assert ml.parse_layers("1-3,7") == [1, 2, 3, 7] and ml.parse_layers(None) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_layer_build_has_no_spills(tmp_path):
    """The real layers' build (RECIPES=1 MMA_ONLY=1). Without MMA_ONLY, the KDA phase makes the recipe build spill
    into the tile loop (16-64 bytes; nvdisasm placed loads in the tile loop), and the k3-small MoE launch took
    0.357 ms against 0.347 before it (12-02). The same for the megakernel backend's builds (EPOCH_PTR=1
    STEP_INPUTS=1 PAIR_TILES=1: the embedding row pointer kept in shared memory, as a register it spilled 4 bytes;
    and with the inputs set around the launch), with one measured exception: since 12-03 19:10 they poll the
    attention x's new row with its queries (ATTN_X_TAIL) beside the tensor-core tile (ATTN_MMA), which spills 4
    bytes, one value stored at the launch's start and loaded once a tile outside the tensor-core loops (nvdisasm);
    that build's layer step took 0.7317 ms against 0.7362 for ATTN_MMA alone, spill-free. The same 4 bytes, no
    more, in the builds that take the greedy token in the launch (ARGMAX=1 and 2, the latter with COMMIT_LENGTHS,
    the step's lengths moved in the launch), in the PDL builds (the step's inputs read after the launch's wait) and
    in those that copy the new row's norm
    weights into shared memory (ATTN_ROW_W_SMEM), and that takes a power-of-two mean as a multiply (POW2_MEAN), all
    12-05 (timed on the H200 that day, ARGMAX=2 aside: none faster). Any other spill fails."""
    from k3export.megakernel.backend import DEFINES, HOST_INPUTS_DEFINES, kernel_defines
    clean = "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
    measured = "8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads"
    for defines, kernel in ((ml.DEFINES, clean), (DEFINES, measured), (HOST_INPUTS_DEFINES, measured),
                            (kernel_defines(argmax=True), measured), (kernel_defines(argmax=2), measured),
                            (kernel_defines(argmax=2, commit_lengths=True), measured),
                            (kernel_defines(pdl=True), measured),
                            (kernel_defines(pdl=True, argmax=2, commit_lengths=True), measured),
                            ((*DEFINES, "ATTN_ROW_W_SMEM=1"), measured),
                            ((*DEFINES, "POW2_MEAN=1"), measured)):
        _, report = mc.compile_cubin(3, 65536, str(tmp_path), defines=defines)
        frames = [ln.strip() for ln in report.splitlines() if "spill stores" in ln]   # (the kernel and attn_tile)
        assert frames == [kernel, clean], (defines, report)


@pytest.mark.cuda
def test_moe_sublayers_in_the_kernel_match_emulation_and_compile():
    """Two k3-small MoE sublayers in one launch: every GEMV / routed phase from the kernel's own x within
    CHECK_REL, the top-k bit for bit, the recipes' x element for element (the RMSNorm's sum of squares is summed in
    another order: a few flips allowed); against the compile backend's MoE on the same input, the same experts."""
    _needs_the_kernel()
    res = ml.run("k3-small", [1, 2], rounds=1, iters=3)       # (raises where the kernel differs from emulation)
    for m in ("stream", "serial"):
        rx = {k: v for k, v in res["check"][m]["recipe_x"].items() if ".moe." in k}
        assert sum(v["differ"] for v in rx.values()) <= 4, rx
    moe = [r for r in res["vs_compile"] if r["sublayer"] == "moe"]
    assert len(moe) == 2 and all(r["same_experts"] for r in moe), res["vs_compile"]
    assert all(r["max_rel"] < 2e-2 for r in res["vs_compile"]), res["vs_compile"]


@pytest.mark.cuda
def test_kda_sublayers_in_the_kernel_match_triton_and_compile():
    """Two k3-small KDA + MoE layers in one launch. The KDA step against the plugin's Triton kernel on the kernel's
    own inputs (Triton 3.6's arithmetic: ex2.approx, div.full, approximate square roots; the sums in other orders):
    the conv window exact, the state within 1e-6, the output within a bf16 step of its largest (KDA_BOUNDS says
    why); against
    the emulation within KDA_BOUNDS (run raises otherwise); the whole sublayer against compile's (its GEMVs sum in
    another order) within 2e-2."""
    _needs_the_kernel()
    res = ml.run("k3-small", [1, 2], rounds=1, iters=3, modes=("stream",))
    assert res["kda"]
    for m in ("stream", "serial"):
        tri = res["check"][m]["kda_vs_triton"]
        assert len(tri) == 2, tri
        for v in tri.values():
            assert v["conv_differ"] == 0 and v["state_max_rel"] <= 1e-6 and v["o"]["max_rel"] <= 2 ** -8, tri
    kda = [r for r in res["vs_compile"] if r["sublayer"] == "kda"]
    assert len(kda) == 2 and all(r["max_rel"] < 2e-2 for r in kda), kda


def test_kda_sublayer_is_three_phases_and_its_emulation_is_the_models_step(tiny128):
    """A KDA layer's attention as in | step | o (f = f_b f_a summed in the step, as the Triton kernel does; the head
    norm and gate in o's x); the chain's emulation (the kernel's orders; exact exp / sqrt / divisions) against the
    model's own decode (plugins/kda reference) from the same state: measured 0 of 64 outputs differing, state
    within 8.4e-8. The step's tiles hold f_b's rows and a quarter of the state's columns; the conv window is
    written to the copy the launch does not read."""
    cfg, model = tiny128
    chain = ml.layers_chain(model, [1, 2], kda=True)
    names = [p.name for p in chain.phases]
    assert names[:3] == ["L1.kda.in", "L1.kda.step", "L1.kda.o"] and names[3] == "L1.moe.proj"
    assert len(names) == 2 * (3 + 7) and chain.phases[10].name == "L2.kda.in"
    attn, H, K = model.model.layers[1].self_attn, 2, 128
    inp, step, out = chain.phases[:3]
    assert (inp.n, step.n, step.ntiles, step.rows, step.src, out.src) == (K + 4 * H * K + H, H * K, 4 * H, 32, 0, 1)
    assert step.bytes_read == 4 * H * (32768 + 16384)
    assert torch.equal(chain.init[0][:K], attn.f_a_proj.weight) and torch.equal(chain.init[0][-H:], attn.b_proj.weight)
    seg, norm = chain.xsegs[step.xop], chain.xsegs[out.xop]
    assert (seg.op, seg.src, seg.route, seg.off, seg.stride, seg.nslot) == ("kda", 0, 0, K, K + 4 * H * K, H)
    assert (norm.op, norm.src, norm.route, norm.off2, norm.len) == ("headnorm", 1, 0, K + 3 * H * K, H * K)
    assert torch.equal(seg.tensors["f_b"], attn.f_b_proj.weight) and torch.equal(norm.aux, attn.o_norm.weight)
    assert chain.phases[3].src == 2 and chain.phases[3].dep2 == -1       # the MoE reads the KDA sublayer's output
    bufs = mc.Buffers(chain, device="cpu")
    bufs.x.copy_(torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16().float())
    bufs.clear()
    bufs.run_reference()
    subs, xs, ys = ml.sublayer_phases(bufs), ml.sublayer_inputs(bufs), ml.outputs(bufs)
    for p, x, y in zip(subs, xs, ys):
        if not chain.phases[p].name.endswith(".kda.o"):
            continue
        layer, sp = int(chain.phases[p].name[1]), p - 1          # (the step: the phase before "o")
        init = bufs.kda_init[sp]
        ref, conv, state = model.model.layers[layer].self_attn.decode(x[None], init["conv_state"][None],
                                                                      init["state"][None])
        r = ml.compare(y.bfloat16(), ref[0])
        assert r["differ"] <= 2 and r["max_rel"] < 1e-2, r
        assert (bufs.kda_state(sp) - state[0]).abs().max() <= 1e-6 * state.abs().max()
        assert torch.equal(bufs.kda_conv(sp), conv[0]) and bufs.kda_conv_out == 1
        assert torch.equal(bufs.kda[sp]["conv2"][0], init["conv_state"])     # (the copy this launch read)
        assert not torch.equal(bufs.kda_state(sp), init["state"])           # (the step moved it)
        tiles = bufs.kda[sp]["tiles"]                                        # tile 4 h + q: f_b[h], columns 32 q..
        assert torch.equal(tiles[1, 2, :8192].view(torch.bfloat16).view(128, 128), attn_f_b(model, layer)[128:])
        assert torch.equal(tiles[1, 2, 8192:].view(128, 32), bufs.kda_state(sp)[1, :, 64:96])
    e = bufs.errors()                                   # the reference against itself: nothing out of bounds
    assert e["kda_out_of_bounds"] == [] and set(e["kda"]) == {"L1.kda.step", "L2.kda.step"}
    assert all(v == {"o_differ": 0, "o_max_ulps": 0.0, "o_max_rel": 0.0, "state_max_rel": 0.0, "conv_differ": 0}
               for v in e["kda"].values()), e["kda"]
    s = bufs.kda_state(1)
    s[0, 5, 7] += 1e-2 * s.abs().max()             # (over KDA_BOUNDS: a bf16 step of the largest)
    bufs.kda_set_state(1, s)
    bufs.kda_conv(11)[3, 1] += 1
    assert bufs.errors()["kda_out_of_bounds"] == ["L1.kda.step", "L2.kda.step"]
    bufs.clear()                                        # back to the start state
    assert torch.equal(bufs.kda_state(1), bufs.kda_init[1]["state"])
    assert torch.equal(bufs.kda_conv(11), bufs.kda_init[11]["conv_state"])
    w = mc.FIELDS.index("w")
    assert int(bufs.table[1, w]) == bufs.kda[1]["tiles"].data_ptr()
    bufs.use_mma_layout(32)                             # (the weights' packed copy: the tiles stay where they are)
    assert int(bufs.table[1, w]) == bufs.kda[1]["tiles"].data_ptr()
    assert int(bufs.table[0, w]) == bufs.w_packed.data_ptr()


def attn_f_b(model, layer):
    return model.model.layers[layer].self_attn.f_b_proj.weight


def test_kda_sums_follow_the_kernels_orders():
    """The emulation's sum of squares (a butterfly per warp of 32, then (W0 + W2) + (W1 + W3), as Triton's), its
    state sums (16 partials of 8 k, each in order from a rounded product, added in order) and f's (four quarters
    of 32 columns, then (Q0 + Q1) + (Q2 + Q3), rounded to bf16) against those orders written one operation at a
    time; the head norm against the model's (plugins/kda reference)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(128, generator=g)
    sq = [float(v) ** 2 for v in x.tolist()]
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))
    lanes = [[f32(sq[32 * w + l]) for l in range(32)] for w in range(4)]
    for o in (16, 8, 4, 2, 1):
        lanes = [[f32(ln[l] + ln[l ^ o]) for l in range(32)] for ln in lanes]
    W = [ln[0] for ln in lanes]
    assert float(mc.kda_sumsq(x)) == f32(f32(W[0] + W[2]) + f32(W[1] + W[3]))
    def chunks(x, y, n):            # x, y: 128 floats; partials of n in order
        q = []
        for k0 in range(0, 128, n):
            a = f32(x[k0] * y[k0])
            for i in range(k0 + 1, k0 + n):
                a = f32(x[i] * y[i] + a)            # (exact product in fp64, one rounding: an fma)
            q.append(a)
        return q

    def quarters(x, y):
        q = chunks(x, y, 32)
        return f32(f32(q[0] + q[1]) + f32(q[2] + q[3]))

    def sixteenths(x, y):
        q, s = chunks(x, y, 8), None
        for v in q:
            s = v if s is None else f32(s + v)
        return s
    S, k = torch.randn(128, 3, generator=g), torch.randn(128, generator=g)
    assert mc.kda_chain_sum(S, k).tolist() == [sixteenths(S[:, j].tolist(), k.tolist()) for j in range(3)]
    fa, fb = torch.randn(128, generator=g).bfloat16(), torch.randn(2, 128, generator=g).bfloat16()
    want = [float(torch.tensor(quarters(fb[r].float().tolist(), fa.float().tolist())).bfloat16()) for r in range(2)]
    assert mc.kda_fold_k3(fa, fb).tolist() == want


def test_kda_phase_is_checked_when_built(tiny, tiny128):
    cfg, model = tiny
    with pytest.raises(ValueError, match="head dim and f_a rank 128"):
        ml.layers_chain(model, [1], kda=True)            # k3-tiny's heads are 16 wide
    _, model = tiny128
    c = ml.layers_chain(model, [1], kda=True)
    seg = c.xsegs[c.phases[1].xop]
    t = dict(seg.tensors)
    kw = dict(q_off=128, b_off=0, fa_off=0, lb=-5.0)
    with pytest.raises(ValueError, match="ends at word"):
        c.kda("x", 0, 2, **dict(kw, q_off=1000), **t)
    with pytest.raises(ValueError, match="needs the tensors"):
        c.kda("x", 0, 2, **kw, state=t["state"])
    with pytest.raises(ValueError, match="f_b"):
        c.kda("x", 0, 2, **kw, **dict(t, f_b=t["f_b"][:, :64]))
    with pytest.raises(ValueError, match="KDA phase's"):
        c.gemv("y", 8, 256, 0, xsegs=[mc.XSeg("kda", 0, 256)])
    w = torch.ones(128)
    with pytest.raises(ValueError, match="reads a KDA phase's heads"):
        c.gemv("y", 8, 256, 0, xsegs=[mc.XSeg("headnorm", 0, 256, route=0, aux=w)])
    with pytest.raises(ValueError, match="reads g at words"):
        c.gemv("y", 8, 256, 0, xsegs=[mc.XSeg("headnorm", 1, 256, route=0, off2=2000, aux=w)])


def test_k3_small_kda_chain_fits_the_kernel():
    """k3-small's 8 KDA + 11 MoE sublayers: 101 phases fit the default ring's shared memory; a KDA sublayer streams
    45.7 MB (input projection 34.1, output 8.4, the step's tiles 3.1: the state 1.0 and f_b's rows for each of a
    head's four tiles, 4 x 0.5)."""
    from k3export.model.k3 import K3Model
    cfg = PRESETS["k3-small"]
    with torch.device("meta"):
        model = K3Model(cfg)
    chain = ml.layers_chain(model, ml.moe_layers(cfg), kda=True, min_tiles=132)
    assert len(chain.phases) == 101 and sum(p.kind == "kda" for p in chain.phases) == 8
    assert mc.smem_bytes(3, 65536, len(chain.phases), len(chain.xsegs)) <= mc.SMEM_LIMIT - 2304
    assert max(mc.row_groups(p, 512, 4) for p in chain.phases if p.kind != "topk") <= mc.GROUPS
    kda_bytes = sum(p.bytes_read for p in chain.phases[:3])
    assert kda_bytes == pytest.approx(45.7e6, rel=2e-3)


def test_kda_head_norm_is_the_references():
    from k3export.plugins.kda.naive import head_rmsnorm_gate
    g = torch.Generator().manual_seed(5)
    o, gate = torch.randn(2, 128, generator=g).bfloat16(), torch.randn(2, 128, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(128, generator=g)).bfloat16()
    ref = head_rmsnorm_gate(o[None], w, gate[None], 1e-5)[0].reshape(-1).bfloat16()     # (as kda_decode rounds it)
    got = mc.kda_headnorm_k3(o.float().reshape(-1), gate.float().reshape(-1), w, 1e-5)
    assert (got != ref.float()).sum() <= 2 and (got - ref.float()).abs().max() <= 2 ** -6 * ref.float().abs().max()


def test_step_chain_adds_layer_0_stand_ins_and_the_head(tiny128):
    """layers_chain with layer 0 (KDA + the dense MLP, its down projection split over k: here one part), an MLA
    layer's stand-in GEMVs, and the final norm + LM head: the emulation's dense output and logits against the
    model's on the same input (equal), the stand-in's output feeding the next MoE."""
    cfg, model = tiny128
    chain = ml.layers_chain(model, [0, 1, 3], kda=True, mla_standins=True, head=True)
    names = [p.name for p in chain.phases]
    assert names[:5] == ["L0.kda.in", "L0.kda.step", "L0.kda.o", "L0.dense.gate_up", "L0.dense.down.0"]
    assert names[5] == "L1.kda.in" and names[-1] == "lm_head" and "L3.mla.o" in names
    assert chain.phases[names.index("L3.moe.proj")].src == names.index("L3.mla.o")
    norm = chain.xsegs[chain.phases[-1].xop]
    assert (norm.op, norm.src, norm.route) == ("norm", names.index("L3.moe.up"), names.index("L3.moe.shared_down"))
    bufs = mc.Buffers(chain, device="cpu")
    bufs.x.copy_(torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16().float())
    bufs.clear()
    bufs.run_reference()
    seen = set()
    for p, x, y in zip(ml.sublayer_phases(bufs), ml.sublayer_inputs(bufs), ml.outputs(bufs)):
        name = chain.phases[p].name
        if ".dense.down." in name:
            ref = model.model.layers[0].mlp(x[None])[0]
        elif name == "lm_head":
            ref = model.lm_head(model.model.norm(x[None]))[0]
        else:
            continue
        seen.add(name)
        assert ml.compare(y.bfloat16(), ref)["differ"] == 0, name
    assert seen == {"L0.dense.down.0", "lm_head"}


def test_sum_recipe_adds_the_parts_in_order():
    """The dense down projection of k3-small (k = 8192) as four phases of k = 2048, their outputs added by the next
    phase's x ("sum", in order, one bf16 rounding), against one fp32 sum of the whole."""
    c = mc.Chain(64)
    parts = [c.gemv(f"down.{q}", 64, 32, -1) for q in range(4)]
    nxt = c.gemv("next", 16, 64, parts[0], xsegs=[mc.XSeg("sum", parts[0], 64, nslot=4)])
    b = mc.Buffers(c, device="cpu")
    b.clear()
    b.run_reference()
    x = b.recipe_x(nxt)
    want = ((b.out(0) + b.out(1)) + b.out(2)) + b.out(3)
    assert torch.equal(x, want.bfloat16().float())
    with pytest.raises(ValueError, match="'sum' adds"):
        c.gemv("bad", 16, 64, parts[0], xsegs=[mc.XSeg("sum", parts[2], 64, nslot=4)])   # (runs past the parts)


def test_k3_small_step_chain_fits_the_kernel():
    """The whole k3-small step as layers_chain builds it (MLA attention as stand-ins): 137 phases, 1462 MB, within
    the default ring's shared memory (4 KB to spare); every tile a tensor-core tile (MMA_ONLY)."""
    from k3export.model.k3 import K3Model
    with torch.device("meta"):
        model = K3Model(PRESETS["k3-small"])
    c = ml.layers_chain(model, list(range(12)), kda=True, mla_standins=True, head=True, min_tiles=132)
    assert len(c.phases) == 137 and c.bytes_read == pytest.approx(1462e6, rel=1e-3)
    assert mc.smem_bytes(3, 65536, len(c.phases), len(c.xsegs)) <= mc.SMEM_LIMIT - 2304
    assert all(ph.n % ph.rows == 0 and mc.mma_tile(ph.rows, ph.rows, ph.k)
               for ph in c.phases if ph.kind in ("gemv", "routed"))
    assert [p.k for p in c.phases if ".dense.down." in p.name] == [2048] * 4


def test_plot_from_a_saved_result(tmp_path):
    """--replot: a saved result (here a hand-made one) gives a PNG without a GPU; time_by_group attributes each phase's
    finish-to-finish time to its sublayer kind."""
    res = {"preset": "k3-small", "layers": [0, 1], "phases": 4, "bytes_read": 4e6, "device": "test",
           "phase_names": ["L0.kda.in", "L0.dense.down.0", "L1.moe.up", "lm_head"], "phase_bytes": [1e6] * 4,
           "timeline_us": [2.0, 5.0, 9.0, 10.0], "copy_gbs": 4000.0, "ms": {"stream": 0.01, "compile": 0.02},
           "head": True}
    assert ml.time_by_group(res) == {"kda": 2.0, "dense": 3.0, "moe": 4.0, "head": 1.0}
    out = tmp_path / "p.png"
    ml.plot(res, str(out), ml.TARGET_MS["k3-small"])
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(KeyError):
        ml.phase_group("L1.xyz.a")


def _model_step(model, tok, bufs, chain):
    """The model's own decode step (forward_decode) from the chain's start states (KDA states, MLA caches): the
    logits and every sublayer's input x, captured by the name of the chain's mix phase that should equal it."""
    cfg, caps, hooks = model.config, {}, []
    for l, layer in enumerate(model.model.layers):
        def attn(x, *a, orig=layer.self_attn.decode, l=l):
            caps[f"L{l}.mix.attn"] = x
            return orig(x, *a)
        layer.self_attn.decode = attn                   # (an instance attribute: deleted below)
        hooks.append((layer.mlp if cfg.is_dense(l) else layer.block_sparse_moe).register_forward_hook(
            lambda m, i, o, l=l: caps.__setitem__(f"L{l}.mix.mlp", i[0])))
    kp = [p for p, _ in bufs.kda_phases()]
    conv = torch.stack([bufs.kda_init[p]["conv_state"] for p in kp])[:, None]
    state = torch.stack([bufs.kda_init[p]["state"] for p in kp])[:, None]
    mlas = [chain.mlas[p] for p in sorted(chain.mlas)] or [      # (emulated "mla" phases, or chain.cu's attn)
        {"cache": bufs.cache_init[p][:chain.cache_len(p)], "cache_len": chain.cache_len(p)}
        for p in sorted(chain.caches)]
    cache = (torch.stack([m["cache"] for m in mlas])[:, None] if mlas else torch.zeros(0, 1, 4, cfg.latent_dim))
    cache_len = torch.tensor([mlas[0]["cache_len"] if mlas else 0])
    try:
        with torch.no_grad():
            logits, *_ = model.forward_decode(torch.tensor([tok]), conv, state, cache, cache_len)
    finally:                                            # (the fixture's model is shared: leave it as it was)
        for layer in model.model.layers:
            del layer.self_attn.decode
        for h in hooks:
            h.remove()
    return logits[0].float(), caps


def _compare_step(chain, bufs, logits, caps, drift: float, logit_bound: float):
    """Every sublayer input equal to the model's through layer 1, within `drift` of its largest element after; the
    same argmax token; logits within `logit_bound` of the largest."""
    names = [p.name for p in chain.phases]
    assert set(caps) == {n for n in names if ".mix." in n}
    for name, x in caps.items():
        got = bufs.out(names.index(name))[:chain.x_len]
        rel = ml.compare(got.bfloat16(), x[0].bfloat16())["max_rel"]
        assert rel == 0 if int(name.split(".")[0][1:]) <= 1 else rel < drift, (name, rel)
    got = bufs.out(len(names) - 1)
    assert int(got.argmax()) == int(logits.argmax())
    assert (got - logits).abs().max() <= logit_bound * logits.abs().max()


def test_chain_with_attnres_is_the_models_decode_step():
    """layers_chain(attnres=True) on an all-KDA k3-tiny (heads of 128): Block AttnRes as "mix" phases before every
    sublayer and the head (computed in the consumers' x loads: the "attnres" recipe), the rows sealed as the model
    seals them. Its emulation against the model's
    own decode step from the same states: every sublayer's input equal through layer 1; later ones drift by the
    model's bf16 roundings (the MoE's sums in another order flip an element, and a random tiny model amplifies it:
    measured at most 0.066 of the largest element), and the logits' largest stays the same (measured max
    difference 0.166 of the largest logit)."""
    from k3export.model.weights import random_model
    base = K3Config.from_name("k3-tiny")
    lac = dataclasses.replace(base.linear_attn_config, num_heads=2, head_dim=128,
                              kda_layers=tuple(range(1, base.num_hidden_layers + 1)), full_attn_layers=())
    cfg = dataclasses.replace(base, linear_attn_config=lac)
    model = random_model(cfg, seed=0, dtype=torch.bfloat16).eval()
    L = cfg.num_hidden_layers
    chain = ml.layers_chain(model, list(range(L)), kda=True, head=True, attnres=True)
    names = [p.name for p in chain.phases]
    assert names[0] == "L0.mix.attn" and names[-2:] == ["final.mix", "lm_head"]
    mixes = chain.mixes
    assert mixes[0].bank == [] and mixes[0].p_prev == "input"                 # layer 0: x = input_layernorm(h)
    seals = [m.bank for q, m in mixes.items() if chain.phases[q].name.endswith("mix.mlp")]
    assert [len(b) for b in seals] == [1 + l // cfg.attn_res_block_size for l in range(L)]
    with pytest.raises(ValueError, match="whole step"):
        ml.layers_chain(model, [1, 2], kda=True, attnres=True)
    # every mix is its consumers' x recipe, and exactly one of them (the first) writes its words
    writers = chain.mix_writers()
    assert set(writers) == set(mixes)
    for q in mixes:
        users = [p for p, ph in enumerate(chain.phases) if ph.xop >= 0 and chain.xsegs[ph.xop].op == "attnres"
                 and chain.xsegs[ph.xop].src == q]
        assert users and writers[q] == users[0], (chain.phases[q].name, users)
        assert all(chain.phases[p].kind == "gemv" and chain.phases[p].nxseg == 1 for p in users)
        assert len({chain.phases[p].xop for p in users}) == 1      # (the consumers of a mix share its part)
    bufs = mc.Buffers(chain, device="cpu")
    bufs.x.copy_(model.model.embed_tokens.weight[7].float())
    bufs.clear()
    bufs.run_reference()
    _compare_step(chain, bufs, *_model_step(model, 7, bufs, chain), drift=0.1, logit_bound=0.25)
    e = bufs.errors()
    assert e["mix_out_of_bounds"] == [] and set(e["mix"]) == {chain.phases[q].name for q in mixes}
    q = max(mixes)                                  # the final mix: 1 + 2 bank rows of k3-tiny's blocks, p, y
    m, aux = mixes[q], bufs.aux[chain.phases[q + 1].xop]
    f = struct.unpack(mc.MIX_AUX, bytes(aux.tolist()))
    assert f[2:4] == (len(m.bank), len(m.y)) and f[4:4 + len(m.bank)] == tuple(b[0] for b in m.bank)
    assert f[10:12] == tuple(m.p_prev) and f[12:12 + len(m.y)] == tuple(m.y) and f[18] == writers[q] == q + 1
    x, pv = bufs.mix_words(q)
    assert torch.equal(torch.cat([x, pv]), bufs.mix_out(q))                  # (p packed two a word, and back)
    pv[-1] += 1.0
    bufs.set_mix(q, x, pv)                          # a wrong p element: found, and out of bounds
    assert bufs.mix_errors(q)["p_differ"] == 1 and chain.phases[q].name in bufs.errors()["mix_out_of_bounds"]


def test_chain_with_attnres_and_mla_is_the_models_decode_step(tiny128):
    """The same on k3-tiny as it is (MLA at layers 3, 7, 8), the MLA attention as emulated "mla" phases over a random
    16-row latent cache (the model's own decode: a placeholder until the kernel kind exists): sublayer inputs equal
    through layer 1, later within 0.2 of the largest element (measured at most 0.143), the same argmax token,
    logits within 0.1 of the largest (measured 0.015)."""
    cfg, model = tiny128
    L = cfg.num_hidden_layers
    chain = ml.layers_chain(model, list(range(L)), kda=True, head=True, attnres=True, mla_cache=16)
    names = [p.name for p in chain.phases]
    assert [n for n in names if n.endswith(".mla.attn")] == [f"L{l}.mla.attn" for l in cfg.mla_layers]
    with pytest.raises(ValueError, match="attnres"):
        ml.layers_chain(model, list(range(L)), kda=True, mla_cache=16)
    bufs = mc.Buffers(chain, device="cpu")
    bufs.x.copy_(model.model.embed_tokens.weight[11].float())
    bufs.clear()
    bufs.run_reference()
    _compare_step(chain, bufs, *_model_step(model, 11, bufs, chain), drift=0.2, logit_bound=0.1)


@pytest.mark.cuda
def test_step_with_attnres_in_the_kernel_matches_emulation():
    """k3-small's whole step in one launch (the MLA attention as stand-ins) with Block AttnRes computed in the
    consumers' x loads: run raises unless every phase matches its emulation on the kernel's own inputs (GEMVs within
    CHECK_REL, top-k bit for bit, KDA within KDA_BOUNDS, every mix within MIX_BOUNDS: p exact); every mix written;
    the KDA steps against the Triton kernel's state within 1e-6."""
    _needs_the_kernel()
    L = ml.preset_layers("k3-small")
    res = ml.run("k3-small", list(range(L)), rounds=1, iters=3, modes=("stream",), baseline=False,
                 mla_standins=True, head=True, attnres=True)
    for m in ("stream", "serial"):
        mix = res["check"][m]["mix"]
        assert len(mix) == 2 * L + 1 and all(v["p_differ"] == 0 for v in mix.values()), mix
        tri = res["check"][m]["kda_vs_triton"]           # (the KDA steps on AttnRes's inputs, against Triton)
        assert len(tri) == 9 and all(v["conv_differ"] == 0 and v["state_max_rel"] <= 1e-6 for v in tri.values()), tri


@pytest.mark.parametrize("cache_len", [16, 31, 32, 100])
def test_mla_sublayer_emulation_is_the_models_decode(tiny_mla8, cache_len):
    """`mla_sublayer`: the MLA attention as chain.cu runs it (proj, q_b, the per-head BMM1, the attention's key
    blocks, the per-head BMM2 on their combine, the gated output), emulated: the output equal to the model's own
    `GatedMLA.decode` in every bf16 element, the new row appended to the cache equal to the model's, for cache
    lengths on both sides of a key block's edge (32 keys)."""
    cfg, model = tiny_mla8
    l = cfg.mla_layers[0]
    attn, gen = model.model.layers[l].self_attn, torch.Generator().manual_seed(cache_len)
    c = mc.Chain(cfg.hidden_size)
    cache = ml.random_cache(cfg, cache_len, gen)
    o = ml.mla_sublayer(c, attn, [], f"L{l}.gmla.", cache, cache_len)
    kinds = [(p.name.split(".")[-1], p.kind) for p in c.phases]
    assert kinds == [("proj", "gemv"), ("q_b", "gemv"), ("bmm1", "routed"), ("attn", "attn"), ("bmm2", "routed"),
                     ("o", "gemv")]
    at = c.phases[3]
    assert at.n == cache_len + 1 and at.ntiles == -(-(cache_len + 1) // at.rows) * cfg.num_attention_heads // 8
    assert at.bytes_read == cache_len * cfg.latent_dim * 2 * at.ne
    b = mc.Buffers(c, device="cpu")
    b.x.copy_(torch.randn(cfg.hidden_size, generator=gen).bfloat16().float())
    b.clear()
    b.run_reference()
    with torch.no_grad():
        ref, row = attn.decode(b.x.bfloat16()[None], cache[:cache_len][None], torch.tensor([cache_len]))
    assert ml.compare(b.out(o).bfloat16(), ref[0])["differ"] == 0
    assert torch.equal(b.cache[3][cache_len], row[0])
    e = b.errors()
    assert e["max_rel"]["attn"] < 1e-6 and not e["topk_wrong"] and not e["unwritten"], e


def test_key_blocks_past_the_keys_are_neither_checked_nor_combined(tiny_mla8):
    """A launch built with LIVE_SPLITS leaves the attention's words of the key blocks past its keys unwritten (the
    tiles' room up to the capacity): errors() does not count them as unwritten, and BMM2's combine (its x, as the
    emulation forms it from the words there) is the same whatever they hold."""
    cfg, model = tiny_mla8
    l = cfg.mla_layers[0]
    attn, gen = model.model.layers[l].self_attn, torch.Generator().manual_seed(1)
    c = mc.Chain(cfg.hidden_size)
    ml.mla_sublayer(c, attn, [], "L3.gmla.", ml.random_cache(cfg, 40, gen, room=88), 40, capacity=128)
    at, bmm2 = c.phases[3], 4
    assert at.ntiles == 4 * at.ne and at.live_blocks == 2                # 4 key blocks, 2 with keys
    b = mc.Buffers(c, device="cpu")
    b.x.copy_(torch.randn(cfg.hidden_size, generator=gen).bfloat16().float())
    b.clear()
    b.run_reference()
    x = torch.cat([b.x_of(bmm2, h) for h in range(cfg.num_attention_heads)])
    live = 2 * at.ne * at.heads * (at.xlen + 2)
    b.out(3)[live:] = math.nan                                           # as a LIVE_SPLITS launch leaves them
    e = b.errors()
    assert not e["unwritten"] and not e["topk_wrong"] and e["max_rel"]["attn"] < 1e-6, e
    assert torch.equal(torch.cat([b.x_of(bmm2, h) for h in range(cfg.num_attention_heads)]), x)
    b.out(3)[live - 1] = math.nan                                        # (a live word: caught)
    assert b.errors()["unwritten"] == ["L3.gmla.attn"]


def test_mla_attention_phase_is_checked_and_refused_where_it_cannot_run(tiny_mla8, tiny128):
    """errors() finds a wrong attention word and a wrong appended row; Chain.attn refuses heads that are not a
    multiple of 8 and a cache whose keys do not fit 32 key blocks."""
    cfg, model = tiny_mla8
    l = cfg.mla_layers[0]
    attn, gen = model.model.layers[l].self_attn, torch.Generator().manual_seed(0)
    c = mc.Chain(cfg.hidden_size)
    ml.mla_sublayer(c, attn, [], "L3.gmla.", ml.random_cache(cfg, 60, gen), 60)
    b = mc.Buffers(c, device="cpu")
    b.clear()
    b.run_reference()
    assert b.errors()["max_rel"]["attn"] < 1e-6
    b.out(3)[5] += 1.0
    assert b.errors()["max_rel"]["attn"] > 1e-3
    b.run_reference()
    b.cache[3][60, 0] += 1.0
    assert b.errors()["topk_wrong"] == ["L3.gmla.attn"]
    with pytest.raises(ValueError, match="8 a tile"):               # k3-tiny's 4 heads
        cfg4, model4 = tiny128
        ml.mla_sublayer(mc.Chain(cfg4.hidden_size), model4.model.layers[cfg4.mla_layers[0]].self_attn, [], "x.",
                        ml.random_cache(cfg4, 16, gen), 16)
    with pytest.raises(ValueError, match="do not split"):
        ml.mla_sublayer(mc.Chain(cfg.hidden_size), attn, [], "y.", ml.random_cache(cfg, 32 * 64, gen), 32 * 64)


def test_chain_with_the_kernels_mla_equals_the_chain_with_the_models_mla(tiny_mla8):
    """The whole k3-tiny step (8 MLA heads) with Block AttnRes and the MLA attention as chain.cu runs it (`mla`),
    emulated, against the same chain with the MLA attention as the model's own `GatedMLA.decode` ("mla" phases,
    `mla_cache`) over the same caches: every sublayer input and every logit equal, bit for bit, the appended rows
    the model's; and the model's own step picks the same token. (Both chains drift from the model's step by the
    same amount in the later layers: at most 0.356 of the largest element at L7 on this random model, the MoE's
    bf16 roundings amplified; the MLA attention adds nothing to it.)"""
    cfg, model = tiny_mla8
    L = cfg.num_hidden_layers
    runs = {}
    for kw in (dict(mla=16), dict(mla_cache=16)):
        chain = ml.layers_chain(model, list(range(L)), kda=True, head=True, attnres=True, **kw)
        bufs = mc.Buffers(chain, device="cpu")
        bufs.x.copy_(model.model.embed_tokens.weight[11].float())
        bufs.clear()
        bufs.run_reference()
        names = [p.name for p in chain.phases]
        runs[next(iter(kw))] = (chain, bufs, {n: bufs.out(q)[:chain.x_len] for q, n in enumerate(names)
                                              if ".mix." in n}, bufs.out(len(names) - 1))
    (chain, bufs, mixes, logits), (chain_m, bufs_m, mixes_m, logits_m) = runs["mla"], runs["mla_cache"]
    assert [n for n in (p.name for p in chain.phases) if n.endswith(".gmla.attn")] == [
        f"L{l}.gmla.attn" for l in cfg.mla_layers]
    assert mixes.keys() == mixes_m.keys() and all(torch.equal(mixes[n], mixes_m[n]) for n in mixes)
    assert torch.equal(logits, logits_m)
    rows = [bufs_m.out(q)[chain.x_len:] for q in sorted(chain_m.mlas)]     # (the emulated phases' new rows)
    assert all(torch.equal(bufs.cache[p][16].float(), r) for p, r in zip(sorted(chain.caches), rows))
    ref, _ = _model_step(model, 11, bufs, chain)
    assert int(logits.argmax()) == int(ref.argmax())


@pytest.mark.cuda
def test_step_with_the_mla_attention_in_the_kernel_matches_emulation_and_the_model():
    """k3-small's whole step in one launch, everything real: AttnRes and the MLA attention (chain.cu's ATTN over a
    random 1024-row cache) too. run raises unless every phase matches its emulation on the kernel's own inputs
    (the attention's words within CHECK_REL of fp64, recipe x element for element, the appended rows equal); each
    MLA sublayer against the model's own decode on the kernel's input and cache within 1e-2 of its largest element
    (the MLA plugin's contract), the new rows equal."""
    _needs_the_kernel()
    L = ml.preset_layers("k3-small")
    res = ml.run("k3-small", list(range(L)), rounds=1, iters=3, modes=("stream",), head=True, attnres=True,
                 mla=1024)
    rows = [r for r in res["vs_compile"] if r["sublayer"] == "mla"]
    assert len(rows) == 3, res["vs_compile"]
    assert all(r["max_rel"] <= 1e-2 and r["new_row"]["differ"] == 0 for r in rows), rows



def test_greedy_steps_carry_the_states_as_the_model_does(tiny_mla8):
    """Six greedy steps of the whole k3-tiny step (8 MLA heads, AttnRes, the MLA attention as chain.cu runs it over
    16 cache rows with room for 40 more: the tiles' second key block starts empty), each step's KDA states and MLA
    caches carried to the next (`Buffers.advance`, `set_cache_len`), emulated: every step's token the model's own
    `forward_decode` picks from the same states (fed the same tokens), each launch's words equal to their expected
    values (empty key blocks included); a cache length past the tiles is refused."""
    cfg, model = tiny_mla8
    chain = ml.layers_chain(model, list(range(cfg.num_hidden_layers)), kda=True, head=True, attnres=True, mla=16,
                            mla_room=40)
    at = next(iter(chain.caches))
    assert chain.phases[at].ntiles == 2 * cfg.num_attention_heads // 8      # (56 keys: two blocks of 32)
    bufs = mc.Buffers(chain, device="cpu")
    errs = []

    def step():
        bufs.clear()
        bufs.run_reference()
        errs.append(bufs.errors())
    res = ml.greedy_steps(model, bufs, 11, 6, step)
    assert [r["cache_len"] for r in res] == list(range(16, 22))
    assert all(r["token"] == r["model_token"] for r in res), res
    assert all(max(e["max_rel"].values()) == 0 and not e["topk_wrong"] and not e["unwritten"] for e in errs), errs
    assert all(torch.equal(bufs.cache[p][21], bufs.x_of(p)[8 * chain.phases[p].k:].bfloat16()) for p in chain.caches)
    with pytest.raises(ValueError, match="tiles hold 56 keys"):
        bufs.set_cache_len(56)
    # the model restarted from the chain's states every step: the same tokens, each step's logits as close as the
    # first's (measured 0.2035 at step 0, the random model's drift over its layers; at most 0.0213 after)
    chain2 = ml.layers_chain(model, list(range(cfg.num_hidden_layers)), kda=True, head=True, attnres=True, mla=16,
                             mla_room=40)
    follow = ml.greedy_steps(model, mc.Buffers(chain2, device="cpu"), 11, 6, follow=True, ref64=True)
    assert [r["token"] for r in follow] == [r["token"] for r in res]
    assert all(r["token"] == r["model_token"] and r["logits_max_rel"] <= follow[0]["logits_max_rel"]
               for r in follow), follow
    # the model in fp64 from the same states: its argmax is the chain's token every step, and after the first step
    # (from random KDA states and caches: 1.08 of the largest logit for the chain, 1.17 for the model's own bf16) the
    # chain's logits are within 0.05 of its largest (measured 0.003-0.042; the model's own bf16 0.006-0.049)
    assert all(r["fp64_token"] == r["token"] for r in follow), follow
    assert all(r["fp64"]["kernel"] <= 0.05 for r in follow[1:]), [r["fp64"] for r in follow]
    with pytest.raises(ValueError, match="follow"):
        ml.greedy_steps(model, mc.Buffers(chain2, device="cpu"), 11, 1, ref64=True)


@pytest.mark.cuda
def test_greedy_steps_in_the_kernel_match_their_emulation():
    """k3-small's whole step in the kernel for 4 greedy steps, the states (KDA state in its tiles, the conv windows'
    two copies, the MLA caches with their appended rows) carried from launch to launch: greedy_run raises unless
    every launch matches the emulation of its phases on its own inputs. (The tokens against the model's own decode
    are reported, not asserted: a random model's logits can tie within the kernels' bf16 differences.)"""
    _needs_the_kernel()
    res = ml.greedy_run("k3-small", 4)
    assert [r["cache_len"] for r in res["steps"]] == [1024, 1025, 1026, 1027]
    print("tokens", [(r["token"], r["model_token"], round(r["logits_max_rel"], 4)) for r in res["steps"]])


def test_greedy_steps_from_the_models_prefill(tiny_mla8):
    """The model's prefill of a 20-token prompt into a K3State, loaded into the chain's layouts (`load_model_state`:
    the KDA states and conv windows, the MLA caches, the key count), then 5 greedy steps of the chain (emulated), its
    states carried from step to step, with the model (bf16, and fp64) restarted from them every step (`follow`).
    - The first step, from the loaded states: the model's routes and token, its logits within 0.02 of the largest
      (measured 0.007-0.011).
    - Every step where the chain routes as the model does: the model's token and fp64's, the logits within 0.1 of
      the largest from fp64's (measured 0.002-0.073; the model's own bf16 0.003-0.076).
    - Every step, the chain's router keys in each MoE layer up to the first whose experts differ from the model's:
      within 3x of the bf16 model's largest key error from fp64's in that step (`key_err64`; measured 0.9-1.8x).
      So a router that picks otherwise there does so on a tie at bf16: its keys are as good as the model's. Past
      that layer the chain's input carries another expert, and the keys may differ more (up to 9x, measured).
    History of the last check: on 12-05 (a CPU with AMX, torch 2.13) layer 7's router took expert 3 for the model's
    2 at the 5th step, its margin at the cut 0.64 of a bf16 step; on 12-06 (another such CPU) layer 6's took 1 for 2
    at the 2nd step with a margin of 1.12 bf16 steps, so a bound on that margin alone failed. The keys' error from
    fp64 is what says whether the chain's router is right."""
    cfg, model = tiny_mla8
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]])
    state = model.new_state(1, 32)
    with torch.no_grad():
        first = int(model.prefill(prompt, state)[0, -1].argmax())
    chain = ml.layers_chain(model, list(range(cfg.num_hidden_layers)), kda=True, head=True, attnres=True, mla=20,
                            mla_room=8)
    bufs = mc.Buffers(chain, device="cpu")
    assert ml.load_model_state(bufs, model, state) == 20
    res = ml.greedy_steps(model, bufs, first, 5, follow=True, ref64=True)
    assert [r["cache_len"] for r in res] == list(range(20, 25))
    assert not res[0]["routes_differ"] and res[0]["logits_max_rel"] <= 0.02, res[0]
    same = [r for r in res if not r["routes_differ"]]
    assert res[0] in same and all(r["token"] == r["model_token"] == r["fp64_token"] and r["fp64"]["kernel"] <= 0.1
                                  for r in same), res
    for r in res:
        ke = r["key_err64"]
        assert sorted(ke) == [l for l in range(cfg.num_hidden_layers) if l >= cfg.first_k_dense_replace], ke
        first_apart = min((d["layer"] for d in r["routes_differ"]), default=max(ke))
        upto = {l: v for l, v in ke.items() if l <= first_apart}
        model_err = max(v["model"] for v in upto.values())
        assert all(v["kernel"] <= 3 * model_err for v in upto.values()), (r["step"], r["routes_differ"], ke)
    with pytest.raises(ValueError, match="cache holds"):
        long = model.new_state(1, 64)
        with torch.no_grad():
            model.prefill(torch.arange(40)[None] % cfg.vocab_size, long)
        ml.load_model_state(bufs, model, long)


@pytest.mark.cuda
def test_greedy_steps_in_the_kernel_from_the_models_prefill():
    """k3-small: the model's eager prefill of 256 random tokens loaded into the kernel's layouts, then 4 greedy steps
    in the kernel, the model restarted from the kernel's states every step (`follow`): greedy_run raises unless
    every launch matches its emulation; the cache lengths move from 256. (First run 12-06 03:15, an H100: passed;
    tokens equal to the model's at steps 0, 1 and 3; at step 2 they differ, where the model's top two logits tie
    exactly.)"""
    _needs_the_kernel()
    res = ml.greedy_run("k3-small", 4, mla=256, follow=True, prefill=256)
    assert [r["cache_len"] for r in res["steps"]] == [256, 257, 258, 259]
    print("tokens", [(r["token"], r["model_token"], round(r["logits_max_rel"], 4)) for r in res["steps"]])


def test_phase_times_are_read_after_the_phases_a_phase_waits_for():
    """`phase_before`: a phase's times are read after the last to finish of the phases with tiles since the last one
    dealt over the whole grid; a gate dealt beside the attention (`spare`) counts only where it finished last, phases
    without tiles (the AttnRes mixes) never, and unrecorded times (NaN) lose."""
    def phase(ntiles: int, spare: int = 0) -> mc.Phase:
        return mc.Phase(name="p", kind="gemv", n=1, k=8, src=-1, xlen=8, ntiles=ntiles, spare=spare)

    phases = [phase(10), phase(70), phase(128, spare=62), phase(0), phase(32)]   # ..., attn, gate, mix, bmm2
    assert ml.phase_before(phases, [1.0, 20.0, 9.0, math.nan, 25.0]) == {0: -1, 1: 0, 2: 1, 3: 1, 4: 1}
    assert ml.phase_before(phases, [1.0, 20.0, 22.0, math.nan, 25.0])[4] == 2
    assert ml.phase_before(phases, [1.0, 20.0, math.nan, math.nan, 25.0])[4] == 1


def test_x_load_parts_are_read_per_block_after_the_phase_before():
    """`trace_units` keeps each block's first unit per phase (fields in ns after the launch, 0: not reached) and
    `x_load_parts` reads them in us after the phase before finished: first / median / last block; an AttnRes x (its
    sums' barrier marked) by its own parts; the source's last warp after its warp 0."""
    class Kern:
        blocks = 3
        t_start = torch.tensor([1_000_000])
        trace = torch.zeros(3 * mc.TRACE_UNITS * mc.TRACE_FIELDS, dtype=torch.int64)

    tr = Kern.trace.view(3, mc.TRACE_UNITS, mc.TRACE_FIELDS)
    for b in range(3):                      # phase 0 (the source), then phase 1 twice (a routed phase's two slots)
        tr[b, 0, 16], tr[b, 0, 8] = 1, 1_000_000 + 10_000 + 500 * b          # warps done 10.0 / 10.5 / 11.0 us
        for u, extra in ((1, 0), (2, 7_000)):
            tr[b, u, 16] = 2
            tr[b, u, 0] = 1_000_000 + 9_000 + extra                          # begun 9 us (the second unit: later)
            tr[b, u, 4] = 1_000_000 + 11_000 + 1_000 * b + extra             # words 11 / 12 / 13 us
            tr[b, u, 1] = 1_000_000 + 12_000 + 1_000 * b + extra
    units = ml.trace_units(Kern)
    assert sorted(units) == [0, 1] and len(units[1]) == 3
    pt = {"done": [10.0, 20.0]}
    text = ml.x_load_parts(units, [1], pt, {1: 0})
    assert "begun -1.0 / -1.0 / -1.0" in text
    assert "words +1.0 / +2.0 / +3.0" in text
    assert "in shared +2.0 / +3.0 / +4.0" in text
    assert "source's warps done +1.00 us" in text
    assert "old sources" not in text
    tr[:, 1, 11] = tr[:, 1, 4]              # an AttnRes x: its parts by name
    assert "old sources +1.0 / +2.0 / +3.0" in ml.x_load_parts(ml.trace_units(Kern), [1], pt, {1: 0})
    assert ml.x_load_parts(units, [5], pt, {5: 0}) == "x load parts: no trace units"
