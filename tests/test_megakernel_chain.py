"""scripts/megakernel_chain.py (milestone 1 of docs/megakernel.md): the synthetic k3-small chain, its table and
torch reference on the CPU; chain.cu's sm_90a build where nvcc is present; the kernel itself on the GPU (cuda)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from k3export.megakernel import chain as mc  # noqa: E402

# every kind of link at toy widths: 4 layers (dense layer 0, KDA 1-2, MLA 3), 8 experts, top-2
TINY = dict(mc.SKELETON, d=64, q_rank=32, e_lat=64, e_w=32, dense=64, vocab=128, kda_in=256, heads=2, experts=8,
            topk=2, ctx=64, layers=4, mla=(3,), lat=64)


def long_x_chain(slot_bytes: int) -> mc.Chain:
    """The longest x (k = XMAX), long x with a second input, x read with wrap-around from the external input and
    from a phase, an external input plus a second input, and a phase wide enough for MMA_MIN_K = 512."""
    c = mc.Chain(x_len=64, slot_bytes=slot_bytes)
    a = c.gemv("a", 8192, 64, -1)
    b = c.gemv("b.k8192", 64, 8192, a)
    d = c.gemv("d", 4096, 128, -1)                      # the external input, wrapped twice
    e = c.gemv("e.k4096+a", 64, 4096, d, dep2=a)
    f = c.gemv("f.wrap", 64, 256, e)                    # e's 64 outputs, wrapped
    c.gemv("g.x_in+b", 64, 128, -1, dep2=b)
    c.gemv("h", 32, 64, f)
    c.gemv("i.k1024", 64, 1024, a)                      # tiles of 32 rows: tensor cores with MMA_MIN_K=512
    return c


def test_long_x_chain_has_every_kind_of_x():
    c = long_x_chain(65536)
    assert max(ph.k for ph in c.phases) == mc.XMAX
    assert max(ph.k for ph in c.phases if ph.dep2 >= 0) >= mc.XMAX // 2
    assert any(ph.k > ph.xlen for ph in c.phases if ph.src >= 0)
    assert any(ph.src < 0 and ph.dep2 >= 0 for ph in c.phases)
    b = mc.Buffers(c, device="cpu")
    b.run_reference()
    assert b.errors()["max_rel"] == {"gemv": 0.0, "topk": 0.0, "routed": 0.0, "attn": 0.0}


def test_k3_small_chain_moves_the_steps_bytes():
    """The chain reads what docs/megakernel.md counts for k3-small's B = 1 step (1458 MB, ~20 MB of it KDA state
    and MLA cache modelled here by 1 MB phases) over its ~180 links; the skeleton ~100 MB over the same links."""
    c = mc.k3_small_chain()
    s = mc.k3_small_chain(mc.SKELETON)
    assert len(c.phases) == len(s.phases) == 179
    assert abs(c.bytes_read / 1e6 - 1458) / 1458 < 0.02, c.bytes_read
    assert 80e6 < s.bytes_read < 110e6, s.bytes_read
    assert [p.kind for p in c.phases] == [p.kind for p in s.phases]
    assert sum(p.kind == "topk" for p in c.phases) == 11                   # one MoE per layer after the dense one
    routed = sum(p.bytes_read for p in c.phases if p.kind == "routed")
    assert abs(routed / 1e6 - 11 * 37.7) / (11 * 37.7) < 0.01, routed       # 8 of 64 experts, 4.7 MB each


@pytest.mark.parametrize("fuse", [False, True], ids=["links", "fused"])
@pytest.mark.parametrize("slot", [32768, 65536])
@pytest.mark.parametrize("widths", [mc.WIDTHS, mc.SKELETON, TINY], ids=["k3-small", "skeleton", "tiny"])
def test_chain_table_is_what_the_kernel_assumes(widths, slot, fuse):
    """Inputs before their phase; tiles in phase order, whole rows, one slot each; routed tiles within one expert."""
    c = mc.k3_small_chain(widths, slot, fuse)
    tile = 0
    for p, ph in enumerate(c.phases):
        assert ph.tile0 == tile
        tile += ph.ntiles
        assert -1 <= ph.src < p and -1 <= ph.dep2 < p
        if ph.kind == "topk":
            assert ph.ntiles == 1
        else:                                                            # whole tiles, the last may be part of one
            assert (ph.ntiles - 1) * ph.rows < ph.n <= ph.ntiles * ph.rows
        if ph.kind != "topk":
            assert ph.k % 8 == 0 and ph.k <= mc.XMAX and ph.rows * ph.k * 2 <= c.slot_bytes
            assert ph.rows & (ph.rows - 1) == 0                              # a power of two (rows in flight)
        if ph.kind == "routed":
            assert c.phases[ph.route].kind == "topk" and ph.ne % ph.rows == 0
            assert ph.n == c.phases[ph.route].ne * ph.ne
    assert tile == c.ntiles


def test_reference_fills_the_chain_and_errors_find_wrong_rows():
    c = mc.k3_small_chain(TINY)
    b = mc.Buffers(c, device="cpu")
    b.run_reference()
    e = b.errors()
    assert e == {"max_rel": {"gemv": 0.0, "topk": 0.0, "routed": 0.0, "attn": 0.0}, "topk_wrong": [], "unwritten": [],
                 "kda": {}, "kda_out_of_bounds": []}
    # the values stay O(1) down the chain, so a relative bound means the same everywhere
    scales = [b.out(p).abs().max().item() for p, ph in enumerate(c.phases) if ph.kind != "topk"]
    assert 0.1 < min(scales) and max(scales) < 50, (min(scales), max(scales))
    rd = next(p for p, ph in enumerate(c.phases) if ph.kind == "routed" and ph.xstride)
    b.out(rd)[3] += 0.5
    assert b.errors()["max_rel"]["routed"] > 0.01
    tk = next(p for p, ph in enumerate(c.phases) if ph.kind == "topk")
    b.run_reference()
    ids = b.out(tk).clone()
    b.out(tk).copy_(ids.flip(0))                  # same experts, other order: the routed rows follow the ids
    assert b.errors()["topk_wrong"] == [c.phases[tk].name]
    b.run_reference()
    b.out(0)[1] = float("nan")
    assert b.errors()["unwritten"] == [c.phases[0].name]


def test_reference_topk_and_second_inputs():
    """The top-k ranks all of the router's outputs; a phase with a second input adds it to x elementwise; the
    output words hold the value in their low half and the writer's epoch in the high half."""
    c = mc.k3_small_chain(TINY)
    b = mc.Buffers(c, device="cpu")
    b.run_reference()
    for p, ph in enumerate(c.phases):
        if ph.kind == "topk":
            router = b.out(ph.src)
            assert len(router) == TINY["experts"] and ph.xlen == TINY["experts"]
            assert torch.equal(b.out(p), torch.topk(router, TINY["topk"]).indices.float())
        if ph.dep2 >= 0:
            j = torch.arange(ph.k)
            want = (b.out(ph.src)[j % ph.xlen] + b.out(ph.dep2)[j % ph.xlen2]).bfloat16().float()
            torch.testing.assert_close(b.x_of(p), want, rtol=0, atol=0)
    assert sum(ph.dep2 >= 0 for ph in c.phases) == 3 + 1                  # moe.up in layers 1-3, mla.o in 3
    b.clear()
    assert torch.isnan(b.values).all() and ((b.y >> 32) == 0).all()
    b.y[0] = (7 << 32) | 0x3FC00000                                         # epoch 7, 1.5
    assert b.out(0)[0].item() == 1.5


def test_routed_reference_reads_the_chosen_experts():
    c = mc.k3_small_chain(TINY)
    b = mc.Buffers(c, device="cpu")
    b.run_reference()
    rgu = next(p for p, ph in enumerate(c.phases) if ph.kind == "routed")
    ph = c.phases[rgu]
    ids = b.out(ph.route).long().tolist()
    assert len(set(ids)) == len(ids) == TINY["topk"]
    x = b.x_of(rgu)
    for s, e in enumerate(ids):
        want = b.weights(rgu)[e].float() @ x
        torch.testing.assert_close(b.out(rgu)[s * ph.ne:(s + 1) * ph.ne], want, rtol=0, atol=0)


def test_fused_chain_drops_only_the_few_byte_links():
    c, f = mc.k3_small_chain(), mc.k3_small_chain(fuse=True)
    dropped = len(c.phases) - len(f.phases)
    assert dropped == 12 * 2 + 9 + 3 * 2 + 1                              # AttnRes x2, KDA conv, MLA norms / softmax
    assert c.bytes_read - f.bytes_read == dropped * 256 * 256 * 2
    b = mc.Buffers(mc.k3_small_chain(TINY, fuse=True), device="cpu")
    b.run_reference()
    assert b.errors()["max_rel"] == {"gemv": 0.0, "topk": 0.0, "routed": 0.0, "attn": 0.0}


def test_bandwidth_chain_moves_the_same_bytes_without_links():
    b, c = mc.bandwidth_chain(), mc.k3_small_chain()
    assert len(b.phases) == 1 and abs(b.bytes_read - c.bytes_read) / c.bytes_read < 0.001


def test_default_ring_fits_shared_memory_with_the_table():
    n = len(mc.k3_small_chain().phases)
    assert mc.smem_bytes(3, 65536, n) <= mc.SMEM_LIMIT < mc.smem_bytes(4, 65536, n)


def test_blocks_that_cannot_all_be_resident_are_refused():
    """A persistent launch whose blocks wait on each other must have them all on the GPU at once."""
    n = len(mc.k3_small_chain().phases)
    assert mc.not_resident(1, 544, 96, mc.smem_bytes(3, 65536, n)) is None                 # the default build
    assert mc.not_resident(2, 288, 92, mc.smem_bytes(2, 32768, n)) is None                 # 2 blocks, 8 warps each
    assert "registers" in mc.not_resident(2, 544, 96, mc.smem_bytes(2, 32768, n))
    assert "registers" in mc.not_resident(1, 544, 104, mc.smem_bytes(3, 65536, n))   # 5 warps of 104 a quarter
    assert "shared memory" in mc.not_resident(2, 288, 92, mc.smem_bytes(3, 32768, n))
    assert "shared memory" in mc.not_resident(1, 544, 96, mc.smem_bytes(4, 65536, n))


def test_chain_refuses_bad_links():
    c = mc.Chain(x_len=64)
    with pytest.raises(ValueError, match="multiple of 8"):
        c.gemv("odd", 16, 12, -1)
    a = c.gemv("a", 64, 64, -1)
    with pytest.raises(ValueError, match="not before it"):
        c.gemv("later", 64, 64, a + 1)
    with pytest.raises(ValueError, match="not a top-k"):
        c.routed("r", a, 8, 64, 4, a)
    with pytest.raises(ValueError, match="top-100 of 64"):
        c.topk("tk", 100, a)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_chain_cu_builds_for_sm90a_without_spills(tmp_path):
    """chain.cu assembles for sm_90a (mbarrier, bulk copies, ld.acquire / red.release) with every ring the script
    offers, without local memory."""
    for nslot, slot, defines in [(3, 65536, ()), (4, 32768, ()), (2, 65536, ()),
                                 (3, 65536, ("TILE_IN_REGS=1", "CONSUMER_WARPS=8", "STEPS=8")),
                                 (3, 65536, ("TRACE_TILES",)), (3, 65536, ("TRACE",)), (3, 65536, ("WARP_ROWS=1",)),
                                 (3, 65536, ("MMA_TILES=0",)), (3, 65536, ("MMA_MIN_K=512",))]:
        path, report = mc.compile_cubin(nslot, slot, str(tmp_path), defines=defines)
        assert Path(path).stat().st_size > 0
        frames = [ln.strip() for ln in report.splitlines() if "spill stores" in ln]     # (every function)
        assert frames and all(f == "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
                              for f in frames), report


@pytest.mark.parametrize("nblk", [3, 5, 8])
def test_paired_tiles_are_a_permutation_and_give_a_block_one_expert(nblk):
    """PAIR_TILES (`tile_row0(paired=True)`, chain.cu's `tile_row0`): in a routed phase with x per expert over more
    tiles than blocks, the tiles' first rows are every row block once, and a block's tiles run over consecutive row
    blocks, so they share an expert wherever its row blocks are a multiple of the run; every other phase is as
    before."""
    c = mc.k3_small_chain(mc.SKELETON)          # (its routed down projections: 16 tiles, 2 an expert)
    assert any(ph.kind == "routed" and ph.xstride and ph.ntiles > nblk for ph in c.phases)
    shared = 0
    for ph in c.phases:
        rows = [mc.tile_row0(ph, t, nblk, paired=True) for t in range(ph.ntiles)]
        assert sorted(rows) == [t * ph.rows for t in range(ph.ntiles)], ph.name
        if not (ph.kind == "routed" and ph.xstride and ph.ntiles > nblk):
            assert rows == [mc.tile_row0(ph, t, nblk) for t in range(ph.ntiles)], ph.name
            continue
        R = -(-ph.ntiles // nblk)
        for col in range(nblk):
            blocks = [rows[t] // ph.rows for t in range(col, ph.ntiles, nblk)]
            assert blocks == list(range(blocks[0], blocks[0] + len(blocks))), (ph.name, col)
            if (ph.ne // ph.rows) % R == 0 and len(blocks) == R:
                assert len({rows[t] // ph.ne for t in range(col, ph.ntiles, nblk)}) == 1, (ph.name, col)
                shared += 1
    assert shared or nblk != 8                  # (8 blocks: runs of 2, one expert each)
    paired, plain = mc.block_tiles(c, nblk, paired=True), mc.block_tiles(c, nblk)
    assert sorted(x for bt in paired for x in bt) == sorted(x for bt in plain for x in bt)


def test_block_tiles_follow_the_kernels_walk():
    """Tile g of the chain goes to block g % blocks; a block takes its tiles phase by phase; routed tiles carry
    their x slot; a top-k's tile moves no bytes."""
    c = mc.k3_small_chain(TINY)
    tiles = mc.block_tiles(c, 3)
    assert sum(map(len, tiles)) == c.ntiles
    assert sum(nb for bt in tiles for _, _, nb in bt) == c.bytes_read
    for bt in tiles:
        assert [p for p, _, _ in bt] == sorted(p for p, _, _ in bt)
    rd = next(p for p, ph in enumerate(c.phases) if ph.kind == "routed" and ph.xstride)
    slots = [s for bt in tiles for p, s, _ in bt if p == rd]
    assert sorted(set(slots)) == list(range(TINY["topk"]))
    assert all(nb == 0 for bt in tiles for p, _, nb in bt if c.phases[p].kind == "topk")


def hand_made_pipeline() -> dict:
    """`tile_pipeline` of a hand-made trace of one block (three 64 KB tiles: two of phase 0, one of phase 1 whose
    slot the producer waited for), times in ns since an epoch as %globaltimer gives them (~1.7e18, beyond a
    double's ns), and a block that recorded nothing."""
    t0 = 1_700_000_000_000_000_000
    us = [  # want, free, issued, landed, take, have, done
        [0.0, 0.0, 0.0, 2.0, 1.0, 2.0, 2.5],
        [0.1, 0.1, 0.1, 4.0, 2.5, 4.0, 4.5],
        [0.2, 5.0, 5.0, 7.0, 6.0, 7.0, 7.5]]
    tr = torch.zeros(2, 4, mc.TILE_FIELDS, dtype=torch.int64)
    tr[0, :3] = t0 + (torch.tensor(us, dtype=torch.float64) * 1000).round().long()
    tiles = [[(0, 0, 65536), (0, 0, 65536), (1, 0, 65536)], [(0, 0, 65536)]]
    return mc.tile_pipeline(tr, tiles)


def test_tile_pipeline_reads_the_ring_from_its_times():
    r = hand_made_pipeline()
    b = r["per_block_us"]
    assert r["blocks"] == 1
    assert b["stream_stopped"] == pytest.approx(1.0)          # [0, 7] with copies over [0, 4] and [5, 7]
    assert b["stopped_ring_full"] == pytest.approx(1.0)       # waited [0.2, 5) with copies in flight to 4.0
    assert b["producer_waits_for_slot"] == pytest.approx(4.8)
    assert b["wait_first_tile"] == pytest.approx(2.0) and b["wait_other_tiles"] == pytest.approx(1.5)
    assert b["sums"] == pytest.approx(1.5) and b["gaps"] == pytest.approx(1.5)
    assert r["copy_latency_us"]["median"] == pytest.approx(2.0)
    assert len(r["landed_tbs"]) == 8 and r["landed_tbs"][2] == pytest.approx(65536 / 1e6)
    assert r["bins_below_half_peak"] == pytest.approx(5 / 8)


def test_interval_unions_and_overlaps_match_sampling():
    g = torch.Generator().manual_seed(3)
    starts = torch.rand(2, 120, generator=g) * 100
    lens = torch.rand(2, 120, generator=g) * torch.tensor([[3.0], [5.0]])
    x, y = ([(a, a + d) for a, d in zip(starts[i].tolist(), lens[i].tolist())] for i in range(2))
    mx, my = mc._merged(x), mc._merged(y)
    assert all(b0 < a1 for (_, b0), (a1, _) in zip(mx, mx[1:]))                  # disjoint, in order
    t = torch.arange(0, 110, 0.005)
    inx = torch.zeros_like(t, dtype=torch.bool)
    iny = torch.zeros_like(inx)
    for a, b in x:
        inx |= (t >= a) & (t < b)
    for a, b in y:
        iny |= (t >= a) & (t < b)
    assert mc._length(mx) == pytest.approx(inx.sum().item() * 0.005, abs=0.05)
    assert mc._overlap(mx, my) == pytest.approx((inx & iny).sum().item() * 0.005, abs=0.05)


def test_tile_plot_draws_each_traced_launch(tmp_path):
    pytest.importorskip("matplotlib")
    tp = hand_made_pipeline()
    result = {"copy_gbs": 4270.0, "chains": {"k3-small": {"ms": {"nodeps": 0.69}, "tile_pipeline": {"nodeps": tp}}}}
    path = tmp_path / "tiles.png"
    mc.plot_tiles(result, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no -DTRACE_TILES"):
        mc.plot_tiles({"copy_gbs": 1.0, "chains": {"k3-small": {"ms": {}}}}, str(path))


def mma_tile_emulated(packed: torch.Tensor, x: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """What chain.cu's `mma_partials` computes from a packed tile, by the PTX fragment layout of
    mma.m16n8k16.row.col (A: a0..a7 rows g / g + 8, columns 2q + (i & 1) + 8 (i >= 4); B: b0..b3 column g, rows
    2q + (i & 1) + 8 (i >= 2); D: d0, d1 row g, d2, d3 row g + 8), summed over every warp's k blocks."""
    chunks = packed.view(-1, 8)                     # 16-byte chunks of 8 bf16
    xc = x.view(-1, 8)
    out = torch.zeros(rows, dtype=torch.float64)
    for rb in range(rows // 16):
        d = torch.zeros(16, 8, dtype=torch.float64)
        for kb in range(k // 32):
            for step in range(2):                   # U / V / X values 4 step .. 4 step + 3
                a = torch.zeros(16, 16, dtype=torch.float64)
                b = torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, q = divmod(lane, 4)
                    u = chunks[(rb * (k // 32) + kb) * 64 + lane][4 * step:4 * step + 4].double()
                    v = chunks[(rb * (k // 32) + kb) * 64 + 32 + lane][4 * step:4 * step + 4].double()
                    xv = xc[kb * 4 + q][4 * step:4 * step + 4].double()
                    a[g, 2 * q:2 * q + 2], a[g + 8, 2 * q:2 * q + 2] = u[:2], v[:2]           # a0 a1, a2 a3
                    a[g, 2 * q + 8:2 * q + 10], a[g + 8, 2 * q + 8:2 * q + 10] = u[2:], v[2:]  # a4 a5, a6 a7
                    b[2 * q:2 * q + 2, g], b[2 * q + 8:2 * q + 10, g] = xv[:2], xv[2:]       # b0 b1, b2 b3
                d += a @ b
        assert torch.equal(d, d[:, :1].expand(16, 8))  # x in every column: equal columns
        out[rb * 16:rb * 16 + 16] = d[:, 0]
    return out


@pytest.mark.parametrize("rows,k", [(16, 2048), (32, 1024), (64, 256), (64, 128), (32, 576)])
def test_mma_packing_gives_the_tiles_rows(rows, k):
    """A tile packed by `pack_mma_tiles` and read as chain.cu's `mma_partials` reads it (emulated from the PTX
    fragment layout) gives W x; a last tile with fewer rows is left as it is."""
    g = torch.Generator().manual_seed(rows + k)
    w = torch.randn(3 * rows + 8, k, generator=g).bfloat16()
    x = torch.randn(k, generator=g).bfloat16()
    packed = mc.pack_mma_tiles(w, rows)
    assert torch.equal(packed[3 * rows:], w[3 * rows:]) and not torch.equal(packed[:rows], w[:rows])
    for t in range(3):
        got = mma_tile_emulated(packed[t * rows:(t + 1) * rows].reshape(-1), x, rows, k)
        want = w[t * rows:(t + 1) * rows].double() @ x.double()
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert mc.mma_tile(16, 16, 2048) and not mc.mma_tile(4, 4, 8192) and not mc.mma_tile(16, 8, 2048)
    assert torch.equal(mc.pack_mma_tiles(w[:, :24].contiguous(), rows), w[:, :24])   # k not a multiple of 32
    assert torch.equal(mc.pack_mma_tiles(w, rows, min_k=k + 32), w)                   # narrower than MMA_MIN_K


def test_mma_follows_the_builds_defines():
    assert mc.mma_min_k(()) == 32 and mc.mma_min_k(("MMA_MIN_K=512",)) == 512
    assert mc.mma_min_k(("MMA_TILES=0",)) is None
    assert mc.mma_min_k(("WARP_ROWS=1",)) is None and mc.mma_min_k(("TILE_IN_REGS=1", "STEPS=8")) is None
    assert mc.mma_min_k(("WARP_ROWS=0",)) == 32


def test_mma_layout_switches_the_tables_weights():
    c = mc.k3_small_chain(TINY)
    b = mc.Buffers(c, device="cpu")
    plain = b.table[:, mc.FIELDS.index("w")].clone()
    b.use_mma_layout(32)
    packed = b.table[:, mc.FIELDS.index("w")].clone()
    assert (packed - plain).unique().tolist() == [b.w_packed.data_ptr() - b.w.data_ptr()]
    first = b.w_packed.clone()
    b.use_mma_layout(10**6)                                 # another MMA_MIN_K: packed again (here: nothing is)
    assert torch.equal(b.w_packed, b.w) and not torch.equal(first, b.w)
    b.use_mma_layout(None)
    assert torch.equal(b.table[:, mc.FIELDS.index("w")], plain)
    b.run_reference()                                       # the reference reads the plain weights
    assert b.errors()["max_rel"] == {"gemv": 0.0, "topk": 0.0, "routed": 0.0, "attn": 0.0}


def test_every_chain_fits_the_kernels_row_groups():
    """chain.cu unrolls at most GROUPS row groups a tile: true of every chain, with the default consumers and
    with 8 warps of STEPS = 8 (the TILE_IN_REGS build), and refused when it is not."""
    chains = [mc.CHAINS[n](sb) for n in mc.CHAINS for sb in (32768, 65536)] + [long_x_chain(65536)]
    for warps, steps in ((mc.cu_default("CONSUMER_WARPS"), mc.cu_default("STEPS")), (8, 8)):
        for c in chains:
            assert max(mc.row_groups(p, 32 * warps, steps) for p in c.phases if p.kind != "topk") <= mc.GROUPS
    assert mc.row_groups(mc.k3_small_chain().phases[1], 32 * 12, 4) > mc.GROUPS      # 12 warps: 3 groups


@pytest.mark.cuda
@pytest.mark.parametrize("ring", [(4, 32768, ()), (3, 65536, ()),
                                  (3, 65536, ("TILE_IN_REGS=1", "CONSUMER_WARPS=8", "STEPS=8")),
                                  (3, 65536, ("WARP_ROWS=1",)), (4, 32768, ("WARP_ROWS=1", "CONSUMER_WARPS=24")),
                                  (3, 65536, ("MMA_TILES=0",)), (4, 32768, ("MMA_TILES=0",)),
                                  (3, 65536, ("MMA_MIN_K=512",))],
                         ids=["4x32k", "3x64k", "3x64k-tile-in-regs", "3x64k-warp-rows", "4x32k-warp-rows-24",
                              "3x64k-no-mma", "4x32k-no-mma", "3x64k-mma-min-k-512"])
def test_chain_kernel_matches_reference(tmp_path, ring):
    """Every phase's output equals its reference from the kernel's own inputs (fp32 sums in another order),
    the top-k picks the same experts in the same order, no row is left unwritten; in stream and serial mode,
    over several launches (counters carried across epochs); the longest x and x read with wrap-around too."""
    pytest.importorskip("cupy", reason="the chain kernel launches through cupy")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("sm_90a kernel")
    kern = mc.ChainKernel(ring[0], ring[1], build_dir=str(tmp_path), defines=ring[2])
    chains = [mc.k3_small_chain(w, ring[1], fuse) for w, fuse in ((TINY, False), (mc.SKELETON, False), (TINY, True))]
    for chain in chains + [long_x_chain(ring[1])]:
        b = mc.Buffers(chain)
        kern.bind(b)
        for mode in ("stream", "serial", "stream", "serial"):
            b.clear()
            kern.launch(mode)
            kern.check()
            e = b.errors()
            assert e["unwritten"] == [] and e["topk_wrong"] == [], e
            assert max(e["max_rel"].values()) < mc.CHECK_REL, e
        kern.launch("nodeps")                                # the bytes alone: runs to the end, results not checked
        kern.check()


@pytest.mark.cuda
def test_tile_trace_records_every_tile(tmp_path):
    """-DTRACE_TILES: every tile of every block has its seven times, in the order the ring imposes (a copy lands
    after it was issued, is taken after it was wanted and done after it was had), and the outputs stay right."""
    pytest.importorskip("cupy", reason="the chain kernel launches through cupy")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("sm_90a kernel")
    kern = mc.ChainKernel(build_dir=str(tmp_path), defines=("TRACE_TILES",))
    c = mc.k3_small_chain(mc.SKELETON)
    b = mc.Buffers(c)
    kern.bind(b)
    b.clear()
    r = kern.tiles_traced("stream")
    assert max(b.errors()["max_rel"].values()) < mc.CHECK_REL
    tiles = mc.block_tiles(c, kern.blocks)
    tr = kern.tile_trace.view(kern.blocks, mc.TILE_TRACE_MAX, mc.TILE_FIELDS).cpu()
    for blk, bt in enumerate(tiles):
        t = tr[blk, :min(len(bt), mc.TILE_TRACE_MAX)]
        assert (t > 0).all(), blk
        assert (t[:, mc.ISSUED] >= t[:, mc.FREE]).all() and (t[:, mc.FREE] >= t[:, mc.WANT]).all()
        assert (t[:, mc.HAVE] >= t[:, mc.TAKE]).all() and (t[:, mc.DONE] >= t[:, mc.HAVE]).all()
        assert (t[:, mc.LANDED] >= t[:, mc.ISSUED]).all()
    assert r["blocks"] == kern.blocks and r["copy_latency_us"]["median"] > 0


@pytest.mark.cuda
def test_chain_kernel_gives_up_with_what_it_waited_for(tmp_path):
    """A wait that can never be met (a phase reading a later one) ends the launch with the block, phase and tile."""
    pytest.importorskip("cupy", reason="the chain kernel launches through cupy")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("sm_90a kernel")
    kern = mc.ChainKernel(build_dir=str(tmp_path), spin_limit=1 << 16)
    c = mc.k3_small_chain(TINY)
    b = mc.Buffers(c)
    kern.bind(b)
    src = mc.FIELDS.index("src")
    b.table[1, src] = len(c.phases) - 1          # phase 1 reads the LM head, which needs phase 1: never written
    kern.launch("stream")
    with pytest.raises(RuntimeError, match=r"gave up waiting for (an input word of this launch|the top-k's words): "
                                           r"block \d+, phase \d+ \(\S+\), tile \d+"):
        kern.check()
    b.table[1, src] = c.phases[1].src
    kern.launch("stream")                                    # counters, outputs and epoch were reset: a clean launch
    kern.check()
    assert max(b.errors()["max_rel"].values()) < mc.CHECK_REL
