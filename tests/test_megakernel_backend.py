"""`MegakernelBackend` (k3export/megakernel/backend.py): the persistent decode kernel behind the runtime's `Engine`.

On the CPU the backend runs the kernel's torch emulation (`emulate=True`, the same phases op for op), so its
plumbing is tested here: the prefill state loaded into the kernel's layouts, the key count moved per step, the new
MLA rows committed to the engine, a second request after the first, and the refusals. The GPU tests run the kernel
itself (k3-small) against the same emulation and against eager's tokens."""

from __future__ import annotations

import json

import pytest
import torch

from k3export.config import K3Config
from k3export.generate import Sampling
from k3export.megakernel import backend as mb
from k3export.megakernel import chain as mc
from k3export.model.moe import LatentMoE
from k3export.runtime import EagerBackend, Engine, Generator

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19], [7, 1, 8, 2, 8, 1, 8]]


def _eager_tokens(model, prompts, n, max_len):
    return Generator(Engine(EagerBackend(model), max_batch=1, max_len=max_len)).generate(prompts, n)


def test_the_emulated_backend_serves_request_after_request(tiny_mla8):
    """Two requests one after the other through `Generator` (greedy, 6 tokens each): each request's tokens equal
    those of a fresh backend serving it alone (the second starts from its own prefill, the kernel's layouts
    reloaded, not from the first request's state), and its first two (the prefill's, then the first step's from the
    same loaded states) equal the eager engine's; the engine's MLA cache holds the rows the backend appended.
    Later tokens are not held to eager's: the emulation's sums run in other orders, and on this random bf16 model a
    router then and again picks between experts whose scores differ by less than that noise. 12-05, a CPU with AMX
    (torch 2.13): eager's 6th token of the first request 158 (fp64's too), the emulation's 126, after layer 5's
    router had chosen differently at the 2nd and 3rd decode steps (eager's margin at the 16th expert 0.0017 and
    0.00043) and layer 6's at the 5th (0.0061); eager bf16 itself is 0.02-0.17 of the largest logit from fp64 on
    those steps."""
    cfg, model = tiny_mla8
    want = _eager_tokens(model, PROMPTS, 6, 40)

    def served(prompts):
        be = mb.MegakernelBackend(model, max_len=40, prefill_backend=EagerBackend(model), emulate=True)
        eng = Engine(be, max_batch=1, max_len=40)
        return be, eng, Generator(eng).generate(prompts, 6)
    be, eng, got = served(PROMPTS)
    alone = [served([p])[2][0] for p in PROMPTS]
    assert got == alone
    assert [t[:2] for t in got] == [t[:2] for t in want], (got, want)
    assert be.steps == 2 * 5                      # (each request: the prefill, then 5 decode steps)
    assert be.steps_since_load == 5
    with pytest.raises(ValueError, match="no launch to check"):       # (the GPU test checks the kernel's)
        be.first_step_errors(5)
    # the engine's cache rows of the last request equal the kernel's own cache rows
    n = len(PROMPTS[1]) + 5
    assert eng.state.lengths.tolist() == [n]
    for i, p in enumerate(be.attn):
        slot = model.state_slot[int(be.bufs.chain.phases[p].name.split(".")[0][1:])]
        assert torch.equal(eng.state.mla_cache[slot, 0, :n], be.bufs.cache[p][:n])


def _emulated_steps(model, **options) -> list[torch.Tensor]:
    """The emulated backend's logits over three decode steps after PROMPTS[0]'s prefill, with these options."""
    be = mb.MegakernelBackend(model, max_len=40, prefill_backend=EagerBackend(model), emulate=True, **options)
    eng = Engine(be, max_batch=1, max_len=40)
    eng.prefill([0], [PROMPTS[0]])
    return [eng.decode(torch.tensor([t]))[0].clone() for t in (5, 9, 2)]


def _small_layout():
    """k3-small on the meta device: the chain's layout without weights' values."""
    from k3export.model import K3Model
    with torch.device("meta"):
        return K3Model(K3Config.from_name("k3-small")).to(torch.bfloat16)


def test_the_router_first_layout_gives_the_same_step(tiny_mla8):
    """`router_first` moves each MoE's router rows to right after the latent rows in its packed projection (the top-k
    then reads them from the phase's first round of tiles): the same phases' arithmetic on the same rows, so the
    emulated step's logits equal the default layout's bit for bit, step after step; on k3-small the router's tiles
    are among the projection's first 132 (an H200's blocks: each block's first tile; 16-row tiles, the slot's limit
    at k = 2048), where by default they are its last (second-round tiles)."""
    cfg, model = tiny_mla8
    runs = [_emulated_steps(model, router_first=first) for first in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    small = _small_layout()
    for first in (False, True):
        chain = mb.decode_chain(small, 64, router_first=first)
        tops = [ph for ph in chain.phases if ph.kind == "topk"]
        assert len(tops) == 11
        for ph in tops:
            proj, score = chain.phases[ph.src], chain.xsegs[ph.xop]
            tiles = range(score.off // proj.rows, (score.off + score.len - 1) // proj.rows + 1)
            assert proj.rows == 16 and (max(tiles) < 132 if first else min(tiles) >= 132), (proj.name, tiles)


def test_the_gate_apart_gives_the_same_step_and_deals_its_tiles_beside_the_step(tiny_mla8):
    """`g_apart` takes each KDA layer's gate rows out of the input projection into a GEMV phase of their own after
    the step, its x the mix's words, and `mla_g_apart` each MLA layer's out of its projection into one after the
    attention: the same rows' sums, so the emulated step's logits equal the layout before's bit for bit, step after
    step. On k3-small (the layout on an H200's 132 blocks): the input projection is 393 tiles (three rounds) instead
    of 521 (four), every block with a step tile has at most three of them before it, and none of the gate's 128
    tiles runs on a block with a step tile of its layer (they are dealt over the other 68); on a grid where fewer
    than a quarter of the blocks would be left they are dealt over every block, as any phase's. The MLA projection
    is 84 tiles (one round) instead of 212, and its gate's tiles run on blocks without an attention tile."""
    cfg, model = tiny_mla8
    runs = [_emulated_steps(model, g_apart=apart, mla_g_apart=apart) for apart in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    small = _small_layout()
    for apart in (False, True):
        chain = mb.decode_chain(small, 64, g_apart=apart, mla_g_apart=apart)
        names = [ph.name for ph in chain.phases]
        steps = [p for p, ph in enumerate(chain.phases) if ph.kind == "kda"]
        assert len(steps) == 9
        for p in steps:
            step, inp = chain.phases[p], chain.phases[chain.phases[p].src]
            assert inp.ntiles == (393 if apart else 521) and step.ntiles == 64
            tiles = mc.block_tiles(chain, 132)
            step_blocks = {mc.tile_block(step, t, 132) for t in range(step.ntiles)}
            for b in step_blocks:
                before = [q for q, _, _ in tiles[b][:[q for q, _, _ in tiles[b]].index(p)]]
                assert before.count(chain.phases.index(inp)) <= (3 if apart else 4)
            if apart:
                g = chain.phases[p + 1]
                assert g.name.endswith("kda.g") and g.spare == 64 and names[p + 2].endswith("kda.o")
                assert not step_blocks & {mc.tile_block(g, t, 132) for t in range(g.ntiles)}
                assert mc.phase_stride(g, 132) == 68 and mc.phase_stride(g, 80) == 80
                assert sorted(mc.tile_block(g, t, 80) for t in range(80)) == list(range(80))
        for p in (p for p, ph in enumerate(chain.phases) if ph.kind == "attn"):
            proj = chain.phases[names.index(chain.phases[p].name.replace(".attn", ".proj"))]
            assert proj.name.endswith("gmla.proj") and proj.ntiles == (84 if apart else 212)
            if apart:
                g, at = chain.phases[p + 1], chain.phases[p]
                assert g.name.endswith("gmla.g") and g.spare == at.ntiles
                assert not {mc.tile_block(at, t, 132) for t in range(at.ntiles)} & \
                    {mc.tile_block(g, t, 132) for t in range(g.ntiles)}
        if not apart:
            assert not any(ph.spare for ph in chain.phases)


def test_attention_tiles_of_fewer_heads_give_the_same_step(tiny_mla8):
    """`attn_heads`: the MLA attention's tiles take 4 or 2 heads each instead of 8 (more tiles, the same key
    blocks); every (key block, head)'s words are computed as before, so the emulated step's logits equal the
    default's bit for bit, step after step. On k3-small (16 heads) at 1025 keys, 4 heads a tile make 132 tiles (an
    H200's blocks, each one) where 8 make 66; a kernel built for other head groups refuses the chain."""
    cfg, model = tiny_mla8
    runs = []
    for heads in (8, 4, 2):
        be = mb.MegakernelBackend(model, max_len=40, prefill_backend=EagerBackend(model), emulate=True,
                                  attn_heads=heads)
        assert {be.bufs.chain.phases[p].heads for p in be.attn} == {heads}
        eng = Engine(be, max_batch=1, max_len=40)
        eng.prefill([0], [PROMPTS[0]])
        runs.append([eng.decode(torch.tensor([t]))[0].clone() for t in (5, 9, 2)])
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*runs))
    small = _small_layout()
    for heads, tiles in ((8, 66), (4, 132)):
        chain = mb.decode_chain(small, 1025, attn_heads=heads)
        assert [ph.ntiles for ph in chain.phases if ph.kind == "attn"] == [tiles] * 3
    assert "ATTN_HEADS=4" in mb.kernel_defines(attn_heads=4, attn_mma=False) and \
        "ATTN_HEADS=8" not in mb.kernel_defines()
    with pytest.raises(ValueError, match="takes tiles of 8 heads .*pass attn_mma=False"):
        mb.kernel_defines(attn_heads=4)
    assert "16 MLA heads; chain.cu's attention takes them 3 a tile" in mb.unsupported(small, 64, emulate=True,
                                                                                        attn_heads=3)
    with pytest.raises(ValueError, match="attn_heads is the MLA heads an attention tile takes"):
        mb.MegakernelBackend(model, max_len=40, prefill_backend=EagerBackend(model), emulate=True, attn_heads=0)


def test_the_attention_on_tensor_cores_takes_k3_smalls_tiles():
    """chain.cu's ATTN_MMA runs an attention tile on tensor cores (m16n8k16: 8 heads, two blocks of 16 keys), its
    score partials in x's scratch: k3-small's tiles (8 heads of 576-wide rows, rank 512) fit; 4 heads a tile are
    refused with the reason. The backend's options map to their defines."""
    small = _small_layout()
    chunks = mc.cu_default("ATTN_KCHUNKS")
    assert mc.attn_mma_refusal(mb.decode_chain(small, 1025), chunks) is None
    why = mc.attn_mma_refusal(mb.decode_chain(small, 1025, attn_heads=4), chunks)
    assert why and "tiles of 8 heads and 32 keys" in why and "has 4 heads, 32 keys, rows of 576, rank 512" in why
    assert {"ATTN_MMA=1", "ATTN_X_TAIL=1"} <= set(mb.DEFINES)
    assert "ATTN_SUMS_TOGETHER=0" in mb.kernel_defines(sums_apart=True)
    assert not {"ATTN_MMA=1", "ATTN_X_TAIL=1"} & set(mb.kernel_defines(attn_mma=False, x_tail=False))


def test_the_producer_keeps_one_copy_in_flight_by_default():
    """The backend builds chain.cu with INFLIGHT=1 (one weight copy on its way: the boundaries' stores and polls
    queue behind fewer bytes); inflight=0 is the whole ring, as before; a cap the ring cannot have is refused."""
    assert "INFLIGHT=1" in mb.DEFINES and "INFLIGHT=1" in mb.HOST_INPUTS_DEFINES
    assert "NORM_W_FIRST=1" in mb.DEFINES and "NORM_W_FIRST=1" in mb.HOST_INPUTS_DEFINES   # (12-04: -18 us)
    assert not any(d.startswith("INFLIGHT") for d in mb.kernel_defines(inflight=0))
    assert "INFLIGHT=2" in mb.kernel_defines(inflight=2)
    nslot = mc.cu_default("NSLOT")
    for bad in (nslot, -1, 1.5):
        with pytest.raises(ValueError, match="inflight is the weight copies on their way at most"):
            mb.kernel_defines(inflight=bad)


def test_the_launch_takes_the_greedy_token_only_when_asked(tiny_mla8):
    """argmax=True builds chain.cu with ARGMAX=1 (the greedy token taken in the launch, 12-05) and argmax=2 with
    ARGMAX=2 (its keys after the phases), which read the engine's buffers as STEP_INPUTS does: never in the build
    whose inputs are set around the launch, and not by default (12-05 on the H200: no faster); any other value is
    refused; an emulated backend takes no argmax (the engine's program does)."""
    assert "ARGMAX=1" in mb.kernel_defines(argmax=True) and "ARGMAX=2" in mb.kernel_defines(argmax=2)
    assert not any(d.startswith("ARGMAX") for d in mb.kernel_defines(step_inputs=False, argmax=True))
    assert not any(d.startswith("ARGMAX") for d in (*mb.DEFINES, *mb.HOST_INPUTS_DEFINES))
    cfg, model = tiny_mla8
    for bad in (3, -1, 1.0, "2"):
        with pytest.raises(ValueError, match="argmax is False / 0"):
            mb.MegakernelBackend(model, max_len=40, prefill_backend=EagerBackend(model), emulate=True, argmax=bad)
    be = mb.MegakernelBackend(model, max_len=40, prefill_backend=EagerBackend(model), emulate=True, argmax=True)
    assert not be.takes_argmax
    z = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not take the argmax"):
        be.decode_(z, None, None, None, z, argmax=(z, None, torch.ones(1, dtype=torch.bool)))


def test_the_pdl_launch_is_built_only_when_asked_and_leaves_the_graphs_off(tiny_mla8):
    """pdl=True builds chain.cu with PDL=1 (each launch a programmatic dependent one, 12-05), which reads the step's
    inputs after its wait: only with STEP_INPUTS (refused without), not by default. A backend with it asks the engine
    for no CUDA graphs (the overlap is between launches of one stream), and so does cuda_graphs=False; an emulated
    backend launches nothing, so nothing to overlap."""
    assert "PDL=1" in mb.kernel_defines(pdl=True)
    assert "PDL=1" in mb.kernel_defines(pdl=True, argmax=2, commit_lengths=True)
    assert "PDL=1" not in (*mb.DEFINES, *mb.HOST_INPUTS_DEFINES)
    with pytest.raises(ValueError, match="pdl reads the step's inputs"):
        mb.kernel_defines(step_inputs=False, pdl=True)
    cfg, model = tiny_mla8
    for kw in ({"pdl": True}, {"cuda_graphs": False}, {}):
        be = mb.MegakernelBackend(model, max_len=40, prefill_backend=EagerBackend(model), emulate=True, **kw)
        assert not be.launches_pdl and not be.cuda_graphs                 # (an emulation is never captured)
    # the launch's ctypes structures as cuda.h lays them out: CUlaunchAttribute (id, pad to 8, a 64-byte union),
    # CUlaunchConfig (7 unsigned ints, the stream at 32, the attributes at 40, their count at 48)
    import ctypes
    from k3export.megakernel import chain as mc
    assert ctypes.sizeof(mc._LaunchAttribute) == 72 and mc._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(mc._LaunchConfig) == 56
    cfg_ = mc._LaunchConfig
    assert (cfg_.stream.offset, cfg_.attrs.offset, cfg_.nattrs.offset) == (32, 40, 48)


def test_the_launch_commits_the_lengths_only_when_asked(tiny_mla8):
    """commit_lengths=True builds chain.cu with COMMIT_LENGTHS=1 (the step's lengths advanced in the launch, 12-05),
    only with STEP_INPUTS and not by default; an emulated backend commits nothing and refuses the active flags."""
    assert "COMMIT_LENGTHS=1" in mb.kernel_defines(commit_lengths=True)
    assert "COMMIT_LENGTHS=1" in mb.kernel_defines(argmax=2, commit_lengths=True)
    assert "COMMIT_LENGTHS=1" not in mb.kernel_defines(step_inputs=False, commit_lengths=True)
    assert "COMMIT_LENGTHS=1" not in (*mb.DEFINES, *mb.HOST_INPUTS_DEFINES)
    cfg, model = tiny_mla8
    be = mb.MegakernelBackend(model, max_len=40, prefill_backend=EagerBackend(model), emulate=True,
                              commit_lengths=True)
    assert not be.commits_lengths
    z = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="does not advance the lengths"):
        be.decode_(z, None, None, None, z, active=torch.ones(1, dtype=torch.bool))


def test_several_steps_a_launch_are_built_only_when_asked(tiny_mla8):
    """steps_per_launch > 1 builds chain.cu with STEP_LOOP=1 (several greedy steps in one launch, 12-06), which feeds
    each step's token to the next and moves the lengths in the launch: only with ARGMAX and COMMIT_LENGTHS (the
    defines refuse it without, or with PDL), not by default. The emulation runs a step a call, so it refuses more;
    a value that is not a whole number >= 1 is refused. chain.cu refuses the build itself without ARGMAX or
    COMMIT_LENGTHS."""
    defs = mb.kernel_defines(argmax=2, commit_lengths=True, step_loop=True)
    assert "STEP_LOOP=1" in defs and "ARGMAX=2" in defs and "COMMIT_LENGTHS=1" in defs
    assert "STEP_LOOP=1" not in (*mb.DEFINES, *mb.HOST_INPUTS_DEFINES)
    for kw in ({"argmax": 2}, {"commit_lengths": True}, {"argmax": 2, "commit_lengths": True, "pdl": True},
               {"argmax": 2, "commit_lengths": True, "step_inputs": False}):
        with pytest.raises(ValueError, match="several steps a launch"):
            mb.kernel_defines(step_loop=True, **kw)
    src = mc.CU.read_text()
    assert "#if STEP_LOOP && !(ARGMAX && COMMIT_LENGTHS && STEP_INPUTS)" in src
    cfg, model = tiny_mla8
    with pytest.raises(ValueError, match="the emulation runs one step a call"):
        mb.MegakernelBackend(model, max_len=40, prefill_backend=EagerBackend(model), emulate=True,
                             steps_per_launch=4)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="steps_per_launch is the greedy steps"):
            mb.MegakernelBackend(model, max_len=40, prefill_backend=EagerBackend(model), emulate=True,
                                 steps_per_launch=bad)
    be = mb.MegakernelBackend(model, max_len=40, prefill_backend=EagerBackend(model), emulate=True)
    assert be.steps_per_launch == 1
    z = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="steps is 1..1"):
        be.decode_(z, None, None, None, z, steps=2)


def test_paired_tiles_give_each_block_one_expert_of_k3_smalls_moe_down():
    """On an H200 (132 blocks), k3-small's MoE down projections (256 tiles of 32 rows, 32 an expert): by default a
    block with two tiles has two experts' (two x loads); with PAIR_TILES, one (a meta-device model, the layout
    only)."""
    small = _small_layout()
    chain = mb.decode_chain(small, 64)
    downs = [p for p, ph in enumerate(chain.phases) if ph.name.endswith("moe.down")]
    assert len(downs) == 11
    for paired, most in ((False, 2), (True, 1)):
        tiles = mc.block_tiles(chain, 132, paired=paired)
        for p in downs:
            slots = [{s for q, s, _ in bt if q == p} for bt in tiles]
            assert max(map(len, slots)) == most and sum(len(bt) for bt in tiles) == chain.ntiles


def test_the_emulated_backend_reloads_after_fill_slots(tiny_mla8):
    """`Engine.fill_slots` (how `bench model` times a context) writes the state outside decode: the next step
    loads it (the key count from the engine's lengths)."""
    cfg, model = tiny_mla8
    be = mb.MegakernelBackend(model, max_len=24, prefill_backend=EagerBackend(model), emulate=True)
    eng = Engine(be, max_batch=1, max_len=24)
    eng.fill_slots(9)
    eng.decode(torch.tensor([5]))
    assert be.loaded and eng.state.lengths.tolist() == [10]
    assert be.bufs.chain.cache_len(be.attn[0]) == 9 and int(be.bufs.table[be.attn[0], mc.FIELDS.index("n")]) == 10
    eng.decode(torch.tensor([5]))
    assert be.bufs.chain.cache_len(be.attn[0]) == 10
    eng.fill_slots(3)
    assert not be.loaded
    eng.decode(torch.tensor([5]))
    assert be.bufs.chain.cache_len(be.attn[0]) == 3


def test_the_backend_refuses_what_it_cannot_serve(tiny_mla8):
    cfg, model = tiny_mla8
    be = mb.MegakernelBackend(model, max_len=24, prefill_backend=EagerBackend(model), emulate=True)
    with pytest.raises(ValueError, match="max_batch=1"):
        Engine(be, max_batch=2, max_len=24)
    with pytest.raises(ValueError, match="max_len >= 32"):
        Engine(be, max_batch=1, max_len=32)
    with pytest.raises(ValueError, match="NVIDIA GPU"):
        mb.MegakernelBackend(model, max_len=24)
    with pytest.raises(ValueError, match="poll_sleep is whole ns"):
        mb.MegakernelBackend(model, max_len=24, emulate=True, poll_sleep=-5)
    from k3export.model.weights import random_model
    tiny = random_model(K3Config.from_name("k3-tiny"), seed=0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="4 MLA heads"):
        mb.MegakernelBackend(tiny, max_len=24, emulate=True)
    with pytest.raises(ValueError, match="bf16"):
        mb.MegakernelBackend(random_model(cfg, seed=0, dtype=torch.float32), max_len=24, emulate=True)
    with pytest.raises(ValueError, match="key blocks"):
        mb.MegakernelBackend(model, max_len=1 << 16, emulate=True)
    eng = Engine(be, max_batch=1, max_len=24)
    with pytest.raises(ValueError, match="one sequence"):
        be.decode_(torch.tensor([1, 2]), *[None] * 4)
    eng.fill_slots(23)
    eng.decode(torch.tensor([5]))                                  # row 23: the last the caches hold
    with pytest.raises(ValueError, match="full"):
        eng.decode(torch.tensor([5]))


def _needs_the_kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU; run `make test-gpu` on the GPU machine")
    pytest.importorskip("cupy", reason="the chain kernel launches through cupy")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("chain.cu is built for sm_90a")


def _small_model_and_prompts(seed: int, *lengths: int):
    """A random k3-small on the GPU (bf16, seed 0) and random prompts of these lengths (a generator seeded seed)."""
    _needs_the_kernel()
    from k3export.bench.fp8 import gpu_random_model
    model = gpu_random_model(K3Config.from_name("k3-small"), 0)
    g = torch.Generator().manual_seed(seed)
    return model, [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.cuda
@pytest.mark.parametrize("variant", [{}, {"attn_mma": False, "x_tail": False}], ids=str)
def test_the_kernel_backend_follows_its_emulation_on_k3_small(variant):
    """k3-small on the GPU through the engine: a 64-token prompt's prefill loaded into the kernel's layouts, then 8
    steps, the same tokens fed to the kernel backend (launched, and replayed as the engine's CUDA graph), the
    emulated backend and eager (the emulation's greedy tokens). The first launch's phases each equal their
    emulation on the launch's own inputs (`first_step_errors`, as `megakernel_layer.py --greedy` checks every
    launch): fp32 sums in other orders within CHECK_REL, top-k sets and appended rows equal, KDA and mix within
    their bounds. The logits are reported, not asserted: one bf16 rounding that such a sum tips early in the chain
    is amplified by a random model's 12 layers and 11 routers (the first step's logits 2.4e-7 of the largest from
    the emulation's on an H200, 12-03 19:10; 0.0095 on an H100, 12-05 19:15, with every phase within bounds), and
    the KDA states carried are not bit-equal either (~1e-7), so later steps differ by 0.012-1.6.
    The kernel reads and appends the MLA rows in the engine's own cache (`bind_engine_cache`): its 8 new rows are
    written there and equal between the launched and the graphed runs (the step replayed is the step launched, bit
    for bit). The default build's attention runs on tensor cores (`attn_mma`); the CUDA-core tile
    (`attn_mma=False`) is held to the same bounds."""
    model, (prompt,) = _small_model_and_prompts(1, 64)
    kernel = mb.MegakernelBackend(model, max_len=96, prefill_backend=EagerBackend(model), **variant)
    backends = {"emulated": mb.MegakernelBackend(model, max_len=96, prefill_backend=EagerBackend(model),
                                                 emulate=True),
                "kernel": kernel, "kernel, CUDA graph": kernel, "eager": EagerBackend(model)}
    tokens, logits, rows, first_step = None, {}, {}, None
    for name, be in backends.items():
        eng = Engine(be, max_batch=1, max_len=96, cuda_graphs=name == "kernel, CUDA graph")
        assert eng.graphed == (name == "kernel, CUDA graph"), eng.graph_error
        first = int(eng.prefill([0], [prompt])[0].argmax())
        feed, got = [first] + (tokens or []), []
        for i in range(8):
            got.append(eng.decode(torch.tensor([feed[i]], device="cuda"))[0].float().clone())
            if tokens is None:
                feed.append(int(got[-1].argmax()))
            if name == "kernel" and i == 0:
                first_step = kernel.first_step_errors(feed[0])
        tokens = tokens or feed[1:]
        logits[name] = got
        rows[name] = eng.state.mla_cache[:, 0, 64:72].float().clone()        # (the 8 steps' new rows)
    kernel.check()
    assert kernel.steps == 16
    # the step replayed as a CUDA graph == launched step by step, bit for bit (the kernel's sums have fixed orders)
    assert all(torch.equal(a, b) for a, b in zip(logits["kernel, CUDA graph"], logits["kernel"]))
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())
    vs_emu = [rel(a, b) for a, b in zip(logits["kernel"], logits["emulated"])]
    vs_eager = [rel(a, b) for a, b in zip(logits["kernel"], logits["eager"])]
    print("tokens (emulated)", tokens)
    print("kernel argmax", [int(v.argmax()) for v in logits["kernel"]], "eager", [int(v.argmax()) for v in
                                                                              logits["eager"]])
    print("kernel vs emulation", [f"{v:.3g}" for v in vs_emu], "vs eager", [f"{v:.3g}" for v in vs_eager])
    print("first step's phases on their own inputs", first_step)
    assert all(torch.isfinite(v).all() for v in logits["kernel"])
    assert not mc.Buffers.failed(first_step), first_step
    assert torch.equal(rows["kernel, CUDA graph"], rows["kernel"])
    assert all(bool(rows["kernel"][:, i].abs().amax(-1).gt(0).all()) for i in range(8)), "a step's row is unwritten"
    row0 = rel(rows["kernel"][:, 0], rows["emulated"][:, 0])     # (reported: `first_step_errors` checks the rows)
    print("first step's new MLA rows, kernel vs emulation (of the largest):", f"{row0:.3g}")


def test_megakernel_engine_directories_are_refused_where_they_cannot_run(tmp_path, tiny_mla8):
    """`k3export build --backend megakernel` says why it cannot build (here: no GPU; more than one sequence), and
    an engine directory whose cubin came from another chain.cu is refused with that reason."""
    from click.testing import CliRunner
    from k3export.build import build_command
    from k3export.manifest import file_sha256
    from k3export.megakernel import chain as mc
    r = CliRunner().invoke(build_command, ["--backend", "megakernel", "--preset", "k3-tiny", "--dtype", "bf16",
                                           "--out", str(tmp_path)])
    assert r.exit_code != 0 and "--max-batch 1" in r.output, r.output
    r = CliRunner().invoke(build_command, ["--backend", "megakernel", "--preset", "k3-tiny", "--dtype", "bf16",
                                           "--max-batch", "1", "--out", str(tmp_path)])
    assert r.exit_code != 0 and "NVIDIA GPU" in r.output, r.output
    assert mb.stale_build({"megakernel": {"chain_cu_sha256": file_sha256(mc.CU)}}) is None
    assert "another chain.cu" in mb.stale_build({"megakernel": {"chain_cu_sha256": "0" * 64}})
    r = CliRunner().invoke(build_command, ["--backend", "compile", "--preset", "k3-tiny", "--steps-per-launch", "8",
                                           "--out", str(tmp_path)])
    assert r.exit_code != 0 and "--steps-per-launch is for --backend megakernel" in r.output, r.output
    r = CliRunner().invoke(build_command, ["--backend", "megakernel", "--max-batch", "1", "--steps-per-launch", "0",
                                           "--out", str(tmp_path)])
    assert r.exit_code != 0 and "--steps-per-launch" in r.output, r.output


def test_an_engine_directory_runs_eight_greedy_steps_a_launch_unless_built_with_one(tmp_path):
    """The engine directory's build: STEP_LOOP with 8 steps a launch by default (12-06 H200: pipelined greedy 0.683 ms
    a token against 0.693), the plain build with 1; a manifest whose defines are not those of its steps a launch
    (or of this k3export) is refused with a rebuild hint before any kernel is made."""
    from k3export.build import EngineError
    assert mb.ENGINE_STEPS == 8
    assert mb.engine_defines(1) == mb.DEFINES
    assert mb.engine_defines(8) == mb.kernel_defines(argmax=2, commit_lengths=True, step_loop=True)
    assert "STEP_LOOP=1" in mb.engine_defines(8) and "STEP_LOOP=1" not in mb.DEFINES
    for rec in ({"defines": list(mb.DEFINES), "steps_per_launch": 8},           # the plain build, said to loop
                {"defines": list(mb.engine_defines(8))},                        # no steps: from before, one a launch
                {"defines": list(mb.DEFINES), "steps_per_launch": 0}):
        with pytest.raises(EngineError, match="rebuild with `k3export build --backend megakernel`"):
            mb.open_megakernel(tmp_path, {"megakernel": {**rec, "max_len": 96, "ptxas": ""}}, None)
    with pytest.raises(EngineError, match="steps_per_launch is for the megakernel backend"):
        from k3export.build import build
        build("eager", None, tmp_path, steps_per_launch=8)


@pytest.mark.cuda
def test_a_megakernel_engine_directory_builds_opens_and_decodes(tmp_path):
    """k3-small: `build --backend megakernel` (nvcc, the chain bound to the new cubin; 8 greedy steps a launch by
    default, and 1), `load_engine` through the manifest's checks, greedy tokens equal to a single-step backend made
    in process (pipelined: bursts of 8 steps a launch), and a corrupted cubin refused."""
    _needs_the_kernel()
    from k3export.bench.fp8 import gpu_random_model
    from k3export.build import EngineError, build, load_engine, profiles_for
    model = gpu_random_model(K3Config.from_name("k3-small"), 0)
    prompt, n = list(range(100, 164)), 20
    direct = mb.MegakernelBackend(model, max_len=96)
    want = Generator(Engine(direct, 1, 96)).generate([prompt], n)
    del direct
    path1 = build("megakernel", model, tmp_path / "one", profiles=profiles_for(1, 128, 96), echo=print,
                  steps_per_launch=1)
    m1 = json.loads((path1 / "manifest.json").read_text())["megakernel"]
    assert tuple(m1["defines"]) == mb.DEFINES and m1["steps_per_launch"] == 1
    one = load_engine(path1, 1, 96)
    assert one.steps_per_launch == 1 and Generator(one).generate([prompt], n) == want
    del one
    path = build("megakernel", model, tmp_path, profiles=profiles_for(1, 128, 96), echo=print)
    m = json.loads((path / "manifest.json").read_text())
    assert m["megakernel"]["max_len"] == 96 and (path / mb.CUBIN).stat().st_size > 0
    assert m["megakernel"]["steps_per_launch"] == mb.ENGINE_STEPS == 8 and "STEP_LOOP=1" in m["megakernel"]["defines"]
    print("build:", m["build"]["seconds"])
    loaded = load_engine(path, 1, 96)
    assert loaded.steps_per_launch == 8
    got = Generator(loaded).generate([prompt], n)
    assert got == want
    assert Generator(loaded, pipeline=False).generate([prompt], n) == got        # (pipelined: from the host ring)
    assert loaded.post_mark() is not None, loaded.argmax_error
    # sampled on the device (`Engine.decode_sampled` over the launch's strided logits): queued ahead, the plain
    # loop's tokens
    s = Sampling(temperature=0.8, top_p=0.95, seed=3)
    piped = Generator(loaded).generate([prompt], 6, s)
    assert Generator(loaded, pipeline=False).generate([prompt], 6, s) == piped
    print("greedy", got, "sampled", piped)
    data = bytearray((path / mb.CUBIN).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / mb.CUBIN).write_bytes(bytes(data))
    with pytest.raises(EngineError, match="corrupt"):
        load_engine(path, 1, 96)


@pytest.mark.cuda
def test_the_kernel_reading_its_step_inputs_equals_the_host_set_build():
    """chain.cu built with STEP_INPUTS=1 (the backend's default: the launch reads the token's embedding row, the key
    count and its epoch from the engine's buffers) gives the logits of the build whose inputs are set around the
    launch (`step_inputs=False`) bit for bit, step after step under the engine's CUDA graph (the same x values, bf16 rows as the host set them in fp32,
    and the same key counts), for a request and then a shorter one (its epochs restart from a new base above the
    first's: a stale word of the first request would pass for the second's if they did not)."""
    model, prompts = _small_model_and_prompts(2, 64, 40)
    runs = []
    for step_inputs in (False, True):
        be = mb.MegakernelBackend(model, max_len=96, prefill_backend=EagerBackend(model), step_inputs=step_inputs)
        eng = Engine(be, max_batch=1, max_len=96)
        assert eng.graphed, eng.graph_error
        out, toks = [], []
        for r, prompt in enumerate(prompts):
            tok = int(eng.prefill([0], [prompt])[0].argmax())
            feed = [tok] + (runs[0][0][r] if runs else [])        # the second build is fed the first's tokens
            toks.append([])
            for i in range(6):
                out.append(eng.decode(torch.tensor([feed[i]], device="cuda"))[0].float().clone())
                toks[-1].append(int(out[-1].argmax()))
                if not runs:
                    feed.append(toks[-1][-1])
            eng.release(0)
            if step_inputs:                 # [base, largest epoch]: the request's last launch was at length n + 5
                base, high = be.kernel.epoch_dev.tolist()
                print("request", r, "epoch base, largest epoch:", base, high)
                assert high == base + len(prompt) + 5 and (r == 0 or base + len(prompt) == first_high + 1)
                first_high = high
        be.check()
        runs.append((toks, out))
        del eng, be
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


GREEDY_BUILDS = [{"argmax": 1}, {"argmax": 2}, {"argmax": 2, "commit_lengths": True}, {"commit_lengths": True},
                 {"cuda_graphs": False}, {"pdl": True}, {"pdl": True, "commit_lengths": True},
                 {"pdl": True, "argmax": 2, "commit_lengths": True}]


@pytest.mark.cuda
@pytest.mark.parametrize("opts", GREEDY_BUILDS, ids=str)
def test_the_launch_takes_the_engines_greedy_token(opts):
    """Each greedy-step build against the default one (its engine's argmax program and lengths add after the
    launch, the step a CUDA graph), step after step: the same logits bit for bit, the token in the engine's ids buffer
    and its host ring torch.argmax of them, the device length the engine's host copy, and the same Generator tokens
    (pipelined, from the ring, and plain), for a request and a second one (the count of blocks done starts from zero
    each launch). The builds: chain.cu with ARGMAX=1 (`argmax=1`, the token taken in the launch, keys in the LM
    head's tile loop; passed 12-05 07:35 on an H100) or ARGMAX=2 (keys after the phases), with COMMIT_LENGTHS (the
    launch moves the length itself; ARGMAX=2 and COMMIT_LENGTHS passed 12-05 09:09 on an H100), the default build
    without the engine's graphs (`cuda_graphs=False`), and with PDL (`pdl`: each launch a programmatic dependent
    one on the stream, begun while the kernel before it runs; no graphs)."""
    model, prompts = _small_model_and_prompts(4, 64, 33)
    runs = []
    for kw in (opts, {}):
        be = mb.MegakernelBackend(model, max_len=96, prefill_backend=EagerBackend(model), **kw)
        assert be.takes_argmax == bool(kw.get("argmax")) and be.commits_lengths == kw.get("commit_lengths", False)
        assert be.launches_pdl == kw.get("pdl", False)
        eng = Engine(be, max_batch=1, max_len=96)
        graphed = not (kw.get("pdl") or kw.get("cuda_graphs") is False)
        assert eng.graphed == graphed, eng.graph_error
        toks, logits = [], []
        for prompt in prompts:
            first = int(eng.prefill([0], [prompt])[0].argmax())
            ids = eng.decode_greedy(torch.tensor([first], device="cuda"))
            for i in range(8):
                mark = eng.post_mark()
                torch.cuda.synchronize()
                tok = int(ids[0])
                assert tok == int(eng.last_logits[0].argmax()) and eng.posted(mark)[0] == tok, (kw, i)
                assert int(eng.state.lengths[0]) == len(prompt) + 1 + i == mark[0], (kw, i)
                toks.append(tok)
                logits.append(eng.last_logits[0].clone())
                ids = eng.decode_greedy()
            torch.cuda.synchronize()
            eng.release(0)
        gen = [Generator(eng, pipeline=p).generate(prompts, 8) for p in (True, False)]
        be.check()
        assert gen[0] == gen[1]
        runs.append((toks, gen[0], logits))
        print(kw, toks)
        del eng, be
    assert runs[0][:2] == runs[1][:2]
    bad = [i for i, (a, b) in enumerate(zip(runs[0][2], runs[1][2])) if not torch.equal(a, b)]
    assert not bad, f"{opts}: steps {bad} differ from the default build's logits"


@pytest.mark.cuda
def test_several_steps_in_one_launch_equal_single_launches():
    """The STEP_LOOP build (`steps_per_launch=4`) against the default build, both under the engine's CUDA graphs,
    after a 64-token prompt's prefill: two launches of 4 steps (`decode_greedy_steps`) give the 8 tokens of 8 single
    greedy steps (each step's from the host ring), the last step's logits bit for bit and the device length; then
    a single step of the loop build (a launch of one step) the default's next token. The Generator, pipelined (with
    bursts of 4 and single steps at the end) and plain, gives the default build's tokens for a first request and a
    second one (the epoch base moved past the loop's last step)."""
    model, prompts = _small_model_and_prompts(5, 64, 33)
    runs = []
    for kw in ({"steps_per_launch": 4}, {}):
        be = mb.MegakernelBackend(model, max_len=160, prefill_backend=EagerBackend(model), **kw)
        eng = Engine(be, max_batch=1, max_len=160)
        assert eng.graphed, eng.graph_error
        assert eng.steps_per_launch == kw.get("steps_per_launch", 1)
        if kw:
            assert eng._steps_graph is not None, eng.graph_error
        first = int(eng.prefill([0], [prompts[0]])[0].argmax())
        toks, ids = [], torch.tensor([first], device="cuda")
        for _ in range(2):
            if kw:
                eng.decode_greedy_steps(4, ids)
                mark = eng.post_mark()
                torch.cuda.synchronize()
                toks += [row[0] for row in eng.posted_steps(mark, 4)]
            else:
                for j in range(4):
                    eng.decode_greedy(ids if j == 0 else None)
                    mark = eng.post_mark()
                    torch.cuda.synchronize()
                    toks.append(eng.posted(mark)[0])
            ids = None
        torch.cuda.synchronize()
        assert int(eng.state.lengths[0]) == len(prompts[0]) + 8 == eng._host_lengths[0]
        last = eng.last_logits[0].clone()
        assert toks[-1] == int(last.argmax())
        nxt = int(eng.decode_greedy()[0])
        eng.release(0)
        gen = [Generator(eng, pipeline=p).generate(prompts, 11) for p in (True, False)]
        be.check()
        assert gen[0] == gen[1], kw
        runs.append((toks, nxt, gen[0], last))
        print(kw, toks, nxt)
        del eng, be
    assert runs[0][:3] == runs[1][:3]
    assert torch.equal(runs[0][3], runs[1][3])


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"steps_per_launch": 4}], ids=str)
def test_a_nan_router_score_stops_the_launch_with_the_expert(kw):
    """A NaN key in the kernel's top-k (here the first MoE's score-correction bias of expert 5, which only the top-k's
    keys read) ranks nowhere, so some id words would never be written and the producers waiting for them would run
    out of time far from the cause: the launch stops at once and `check` names the expert and the router's phase
    (and, for STEP_LOOP, the step)."""
    model, prompts = _small_model_and_prompts(6, 32)
    first_moe = next(m for m in model.modules() if isinstance(m, LatentMoE))
    with torch.no_grad():
        first_moe.gate.e_score_correction_bias[5] = float("nan")
    # (the engine's graph warm-ups launch already, on the zero state: the check before the first step after the
    # prefill may be the one that raises)
    with pytest.raises(RuntimeError, match=r"router score of expert 5 is NaN \(block \d+, phase \d+ \(\S+\)\)"
                                           + (r"; in a launch of \d+ step\(s\)" if kw else "")):
        be = mb.MegakernelBackend(model, max_len=96, prefill_backend=EagerBackend(model), **kw)
        eng = Engine(be, max_batch=1, max_len=96)
        first = int(eng.prefill([0], [prompts[0]])[0].argmax())     # (eager: the bias only picks; finite)
        if kw:
            eng.decode_greedy_steps(4, torch.tensor([first], device="cuda"))
        else:
            eng.decode_greedy(torch.tensor([first], device="cuda"))
        be.check()


@pytest.mark.cuda
@pytest.mark.parametrize("kw, pipeline", [({}, True), ({"steps_per_launch": 8}, True), ({}, False)], ids=str)
def test_a_launch_that_stops_mid_generation_raises_before_its_tokens_are_taken(kw, pipeline):
    """The kernel's first router bias poisoned (expert 5, in the kernel's own buffers) after 20 tokens of a pipelined
    greedy generation: the launch after stops (err 7), its tokens are never posted (the default build's argmax
    program sees the give-up word and posts UNPOSTED; the STEP_LOOP build posts nothing), and the Generator raises
    the kernel's message where it would have read them; the plain loop reads the give-up word beside the logits.
    Every token taken is the clean run's."""
    model, prompts = _small_model_and_prompts(7, 48)
    be = mb.MegakernelBackend(model, max_len=160, prefill_backend=EagerBackend(model), **kw)
    eng = Engine(be, max_batch=1, max_len=160)
    want = Generator(eng).generate(prompts, 60)[0]
    score = next(i for i, xs in enumerate(be.bufs.chain.xsegs) if xs.op == "score")
    taken = []

    def on_token(r, t):
        taken.append(t)
        if len(taken) == 20:
            be.bufs.aux[score][5] = float("nan")
    gen = Generator(eng, on_token=on_token, pipeline=pipeline)
    gen.submit(prompts[0], 60)
    with pytest.raises(RuntimeError, match=r"router score of expert 5 is NaN"):
        gen.run()
    print(kw, pipeline, f"{len(taken)} tokens taken before the failure")
    assert 20 <= len(taken) < 60 and taken == want[:len(taken)]


CUDA_CORES = {"attn_mma": False}        # (the attention tile on CUDA cores: the variants of that tile compare to it)


@pytest.mark.cuda
@pytest.mark.parametrize("base, variant", [({}, {"g_apart": False, "mla_g_apart": False}),
                                           ({}, {"router_first": True}),
                                           ({}, {"pair_tiles": False}),
                                           ({}, {"poll_sleep": 256}), ({}, {"x_tail": False}),
                                           ({}, {"inflight": 0}), ({}, {"inflight": 2}),
                                           (CUDA_CORES, {**CUDA_CORES, "attn_heads": 4}),
                                           (CUDA_CORES, {**CUDA_CORES, "live_splits": False}),
                                           (CUDA_CORES, {**CUDA_CORES, "sums_apart": True})], ids=str)
def test_the_kernel_variants_equal_the_default_kernel(base, variant):
    """k3-small in the kernel: each KDA and MLA layer's gate rows in its input projection as before 12-04 14:50
    (`g_apart=False, mla_g_apart=False`; the default has them in a phase of their own beside the step / attention,
    dealt over the blocks without a tile of it: the same rows' sums; passed 14:50 the other way round), the router
    rows early in each MoE's packed projection (`router_first`; 12-03 14:04 on
    the H200: passed), and each block's MoE down tiles two experts' as before PAIR_TILES (`pair_tiles=False`; the
    paired build against the unpaired one passed 12-03 14:43, before pairing became the default) give the default
    kernel's logits bit for bit under the engine's CUDA graph, over 6 steps (each row's sum is the same tensor-core
    sum wherever its tile is); so does a build whose waiting consumers sleep between polls (`poll_sleep`; passed
    12-03 16:10), attention tiles of 4 heads (`attn_heads`: each key block and head's words as before; passed 16:46
    and, with LIVE_SPLITS, 17:03) and the attention running its key blocks past the keys as before LIVE_SPLITS
    became the default (`live_splits=False`: 5 key blocks of room, 3 with keys; LIVE_SPLITS against that build
    passed 17:03); so does the attention tile's score sums butterflied one after another as before
    ATTN_SUMS_TOGETHER (`sums_apart`: the same adds; passed 19:10), and the attention x's new row polled in four
    round trips as before ATTN_X_TAIL (`x_tail=False`: the same x; x_tail against that passed 19:10), and the
    producer keeping the whole ring's copies or two on their way (`inflight=0` / `2`; the default keeps one, since
    12-04 evening: the same tiles in the same slots, landing later). The
    attention-tile variants compare with the CUDA-core tile (`attn_mma=False`), the default being on tensor cores.
    (Passed here too before they were dropped as no faster: a router warp choosing each block's experts, 12-03 14:24,
    commit aef7f58; BMM2's combine polling 12 key blocks' words a round and the tensor-core tile's softmax warps
    adding its score chunks, 12-03 21:20, commit 91653d6.)"""
    model, (prompt,) = _small_model_and_prompts(3, 64)
    runs = []
    for kw in (base, variant):
        be = mb.MegakernelBackend(model, max_len=160, prefill_backend=EagerBackend(model), **kw)
        eng = Engine(be, max_batch=1, max_len=160)
        assert eng.graphed, eng.graph_error
        feed = [int(eng.prefill([0], [prompt])[0].argmax())]
        out = []
        for i in range(6):
            out.append(eng.decode(torch.tensor([feed[i]], device="cuda"))[0].float().clone())
            feed.append(int(out[-1].argmax()))
        be.check()
        runs.append(out)
        del eng, be
    assert all(torch.equal(a, b) for a, b in zip(*runs))
