"""Milestone 2 of docs/megakernel.md: the real KDA attention and MoE sublayers of a K3 model (k3-small: layers
1-11; the MLA layers' attention is not built) as phases of the persistent decode kernel (k3export/megakernel/chain.cu,
built with RECIPES=1 MMA_ONLY=1), with the model's weights, compared with the `compile` backend's kernels and
timed against them. GPU only for the kernel; the chain
and its torch emulation are tested on the CPU (tests/test_megakernel_layer.py).

One MoE sublayer at B = 1 is seven phases (the `compile` backend's launches in brackets; docs/megakernel.md,
"Milestone 2: the layer as it runs today"):

    proj         GEMV [L + 2 I_s, d]: latent down | shared gate | shared up       (k3::gemv, packed)
    router       GEMV [E, d], fp32 logits                                        (moe_router_fwd_kernel)
    topk         sigmoid, + correction bias for the choice, top k, weights renormalised   (in moe_pair_gemm1)
    shared_down  GEMV [d, I_s] on SiTU-GLU(shared gate, up)                       (Inductor's SiTU-GLU, and half of
                                                                                   the packed output k3::gemv)
    gate_up      the chosen experts' w1 | w3 rows [2 I, L] on z = proj[:L]       (moe_pair_gemm1)
    down         their w2 rows [L, I] on SiTU-GLU(gate, up) in fp32, per slot     (moe_pair_gemm2_combine)
    up           GEMV [d, L] on RMSNorm(combine)                                  (combine, Inductor's norm, the
                                                                                   other half of the output k3::gemv)

and the sublayer's output is bf16(up + shared_down), added where the next phase loads it. (`--packed-out`: one
output phase over both, as the compile backend packs them; measured slower, docs/perf.md.)
The combine, the norm and the two SiTU-GLUs are x recipes (chain.cu `XSeg`): the consumers compute them while they
load the next phase's x. The sublayers are chained, each one's output the next one's input (no AttnRes, and no
MLA attention yet), so the launch streams k3-small's KDA and MoE bytes with their real dependencies.

    python3 scripts/megakernel_layer.py [--preset k3-small] [--layers 1-11] [--no-kda] [--step [--no-standins]]
                                        [--rounds 3] [--iters 50] [--out F.json]

A KDA layer's attention is three phases before its MoE (`kda_sublayer`: in | step | o), the step a phase kind of
its own, checked also against the KDA plugin's Triton kernel on the kernel's own inputs (`kda_vs_triton`).
`--step`: layers 0-11 with layer 0's dense MLP (`dense_sublayer`), the final norm and the LM head, and the MLA
attention as stand-in GEMVs at its shapes (`mla_standin`, random weights; `--no-standins` leaves them out).
`--mla ROWS`: the MLA attention real instead (`mla_sublayer`: chain.cu's ATTN phase over a random ROWS-row latent
cache), each MLA sublayer also checked against the model's own decode on the kernel's input and cache.

It checks the kernel against the torch emulation of the same phases first (`megakernel_chain.Buffers`: every GEMV
from the kernel's own x, every recipe x element for element), then each sublayer against the model's MoE as the
`compile` backend runs it (packed, k3::gemv, the pair kernels) on the same input, then times the launch against a
CUDA graph of the `compile` backend's MoE sublayers (torch.compile of the same calls, PDL on) and the bytes floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from k3export.megakernel import chain as mc

DEFINES = ("RECIPES=1", "MMA_ONLY=1")      # (chain.cu: the recipes, and tensor-core tiles only: no spills)


def moe_layers(config) -> list[int]:
    return [l for l in range(config.num_hidden_layers) if not config.is_dense(l)]


def kda_start(attn, gen: torch.Generator) -> dict:
    """A KDA layer's state for the chain to start from: the fp32 state N(0, 0.1^2) and the conv window N(0, 1) in
    bf16 (the pre-conv inputs it holds are O(1))."""
    H, K, W = attn.num_heads, attn.head_dim, attn.conv_size
    return {"state": torch.randn(H, K, K, generator=gen) * 0.1,
            "conv_state": torch.randn(3 * H * K, W - 1, generator=gen).bfloat16()}


def kda_sublayer(c: mc.Chain, attn, out: list[int], name: str, start: dict, g_apart: bool = False) -> int:
    """A KDA attention sublayer at B = 1 as three phases (the compile backend's launches in brackets):

        in     GEMV [K + 4 H K + H, d]: f_a | q | k | v | g | b          (k3::gemv, packed)
        step   f = f_b f_a, the conv, norms, gates, delta rule on the state (kda_decode_inplace), four tiles a
               head (32 value columns each)
        o      GEMV [d, H K] on the heads' RMSNorm and gate (the x recipe "headnorm": the step's tiles each hold
               a quarter of a head)                                       (the rest of kda_decode_inplace, k3::gemv)

    g_apart (with `out` a mix): the gate's rows in a GEMV phase "g" of their own, after the step and beside it
    (`Chain.gemv` beside: on the blocks without a step tile), its x the mix's words as the input projection's x load
    wrote them; "in" is then f_a | q | k | v | b. The step needs all of "in", not g: on k3-small "in" drops from
    521 tiles of 16 rows to 393, three rounds on an H200's 132 blocks instead of four, and g's 128 tiles stream on
    the other 68 blocks while the step runs. The same rows' sums: the same outputs bit for bit.

    Its x is the sublayer output `out` (`gemv_on`); returns the "o" phase. `start`: `kda_start`."""
    H, K, d = attn.num_heads, attn.head_dim, attn.q_proj.in_features
    parts = [attn.f_a_proj.weight, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    parts += [attn.b_proj.weight] if g_apart else [attn.g_proj.weight, attn.b_proj.weight]
    w = torch.cat(parts)
    inp = gemv_on(c, out, name + "in", w.shape[0], d, w)
    step = c.kda(name + "step", inp, H, q_off=K, b_off=K + (3 if g_apart else 4) * H * K, fa_off=0,
                 lb=attn.lower_bound, conv_weight=attn.conv_weight(), a_log=attn.A_log, dt_bias=attn.dt_bias,
                 f_b=attn.f_b_proj.weight, **start)
    gate, g_off = (gate_beside(c, out, name, attn.g_proj.weight, step), 0) if g_apart else (inp, K + 3 * H * K)
    norm = mc.XSeg("headnorm", step, H * K, route=gate, off2=g_off, aux=attn.o_norm.weight, eps=attn.eps)
    return c.gemv(name + "o", d, H * K, step, xsegs=[norm], weight=attn.o_proj.weight)


def gate_beside(c: mc.Chain, out: list[int], name: str, weight: torch.Tensor, beside: int) -> int:
    """A sublayer's output gate g = W_g x as a GEMV phase "g" of its own, dealt beside phase `beside` (`Chain.gemv`),
    its x the words of the mix `out` (written by the sublayer's first GEMV's x load): `kda_sublayer`'s and
    `mla_sublayer`'s g_apart."""
    if not (len(out) == 1 and out[0] in c.mixes):
        raise ValueError(f"{name}: g_apart reads the mix's words: the sublayer's x must be a mix (attnres)")
    return c.gemv(name + "g", weight.shape[0], weight.shape[1], out[0], weight=weight, beside=beside)


def gemv_on(c: mc.Chain, out: list[int], name: str, n: int, k: int, weight: torch.Tensor) -> int:
    """A GEMV whose x is a sublayer's output `out`: one phase's words, two phases' added (src, dep2), or more
    phases' added by the "sum" recipe (consecutive phases, in order); or, `out` a "mix" phase, its AttnRes computed in
    the x load (`Chain.gemv_after`)."""
    if len(out) == 1 and out[0] in c.mixes:
        return c.gemv_after(name, n, out[0], weight=weight)
    if len(out) <= 2:
        return c.gemv(name, n, k, out[0] if out else -1, dep2=out[1] if len(out) > 1 else -1, weight=weight)
    return c.gemv(name, n, k, out[0], xsegs=[mc.XSeg("sum", out[0], k, nslot=len(out))], weight=weight)


DENSE_K = 2048     # the dense MLP's down projection in phases of k <= 2048: a tensor-core tile of 16 rows fits a slot


def dense_sublayer(c: mc.Chain, mlp, out: list[int], name: str) -> list[int]:
    """Layer 0's dense SiTU MLP: gate_up, a GEMV [2 I, d] (gate rows, then up rows), and down, a GEMV [d, I] on
    SiTU-GLU of the rounded gate and up (the x recipe "glu", as compile's packed GEMV then SiTU-GLU), split over k
    into I / DENSE_K phases ("down.0", ...: at k = 8192 a slot holds 4 rows, and a tensor-core tile needs 16) whose
    outputs the next phase adds. Returns the down phases."""
    I, d = mlp.down_proj.in_features, mlp.down_proj.out_features
    parts = -(-I // DENSE_K)
    if I % parts or parts > mc.SUM_MAX:
        raise ValueError(f"{name}: the dense MLP's width {I} does not split into at most {mc.SUM_MAX} equal parts "
                         f"of at most {DENSE_K}")
    kq = I // parts
    gu = gemv_on(c, out, name + "gate_up", 2 * I, d, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    return [c.gemv(f"{name}down.{q}", d, kq, gu, weight=mlp.down_proj.weight[:, q * kq:(q + 1) * kq],
                   xsegs=[mc.XSeg("glu", gu, kq, off=q * kq, off2=I, round_in=True, beta=mlp.beta,
                                  lb=mlp.linear_beta)])
            for q in range(parts)]


def mla_standin(c: mc.Chain, out: list[int], name: str, cfg) -> int:
    """Not the MLA attention: GEMVs at its B = 1 decode's shapes (k3_small_chain's: q / kv latents, their norms as a
    256 x 256 link, q_b, the absorbed K, the scores over a 1024-row cache, the softmax as a link, the absorbed V,
    the gate and the output), with random weights, so that a chain can stand for the whole step's bytes and links
    while the real MLA sublayer is not built. Returns its "o" phase."""
    d, H, lat = cfg.hidden_size, cfg.num_attention_heads, 256
    packed = len(out) == 1 and out[0] in c.mixes    # (AttnRes: q_a | kv_a | g in one GEMV, as the model packs them)
    qa = gemv_on(c, out, name + "q_kv_a", cfg.q_lora_rank + cfg.latent_dim + (H * cfg.v_head_dim if packed else 0),
                 d, None)
    nq = c.gemv(name + "norms", lat, lat, qa)
    qb = c.gemv(name + "q_b", H * cfg.qk_head_dim, cfg.q_lora_rank, nq)
    ak = c.gemv(name + "absorb_k", H * cfg.kv_lora_rank, cfg.qk_nope_head_dim, qb)
    sc = c.gemv(name + "scores", 1024, cfg.latent_dim, ak)
    sm = c.gemv(name + "softmax", lat, lat, sc)
    av = c.gemv(name + "absorb_v", H * cfg.v_head_dim, cfg.kv_lora_rank, sm)
    gt = -1 if packed else gemv_on(c, out, name + "gate", H * cfg.v_head_dim, d, None)
    return c.gemv(name + "o", d, H * cfg.v_head_dim, av, dep2=gt)


def mla_sublayer(c: mc.Chain, attn, out: list[int], name: str, cache: torch.Tensor, cache_len: int,
                 capacity: int = 0, heads_tile: int = mc.ATTN_HEADS, g_apart: bool = False) -> int:
    """A Gated MLA attention sublayer at B = 1 (`GatedMLA.decode`) over the latent cache's rows [:cache_len] (`cache`
    [> cache_len, rank + pe]; the launch appends the new row at cache_len), as six phases:

        proj   GEMV [q_rank + rank + pe + H v, d]: q_a | kv_a | g            (the model's packing)
        q_b    GEMV [H (nope + pe), q_rank] on RMSNorm(q_a) (the x recipe "norm")
        bmm1   per head h (a fixed route): W_UK[h]^T [rank, nope] on q_b's nope words of head h
        attn   the latent attention (chain.cu's ATTN): the queries [bmm1 | q_pe], the keys the cache rows and the new
               row [RMSNorm(kv_a's latent) | its pe]; per key block and head the partial max, sum and output
        bmm2   per head: W_UV[h] [v, rank] on the head's partials combined (the recipe "mla_combine")
        o      GEMV [d, H v] on bf16(sigmoid(g) o) (the recipe "gate")

    g_apart (with `out` a mix): the gate's rows in a GEMV phase "g" of their own after the attention and beside it
    (`Chain.gemv` beside: on the blocks without an attention tile), its x the mix's words as proj's x load wrote
    them; proj is then q_a | kv_a. Nothing before o reads g: on k3-small proj drops from 212 tiles of 16 rows to 84,
    one round on an H200's 132 blocks instead of two. The same rows' sums: the same outputs bit for bit.

    Its x is the sublayer output `out` (`gemv_on`); returns the "o" phase. capacity: keys the attention's tiles hold
    (`Chain.attn`; default cache_len + 1); heads_tile: the attention's heads a tile (`Chain.attn`)."""
    H, rank, nope, pe, v = attn.num_heads, attn.rank, attn.nope, attn.rope, attn.v_dim
    qr, d = attn.q_a_proj.out_features, attn.q_a_proj.in_features
    parts = [attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight]
    w = torch.cat(parts if g_apart else parts + [attn.g_proj.weight])
    proj = gemv_on(c, out, name + "proj", w.shape[0], d, w)
    qb = c.gemv(name + "q_b", H * (nope + pe), qr, proj, weight=attn.q_b_proj.weight,
                xsegs=[mc.XSeg("norm", proj, qr, aux=attn.q_a_layernorm.weight, eps=attn.q_a_layernorm.eps)])
    w_uk, w_uv = attn.absorbed_weights()
    ql = c.heads(name + "bmm1", H, rank, nope, qb, nope + pe, weight=w_uk.transpose(1, 2))
    at = c.attn(name + "attn", ql, qb, proj, qr, H, rank, nope, pe, cache, cache_len, attn.scale,
                attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps, capacity=capacity, heads_tile=heads_tile)
    blocks = c.phases[at].ntiles // c.phases[at].ne
    gate, g_off = (gate_beside(c, out, name, attn.g_proj.weight, at), 0) if g_apart else (proj, qr + rank + pe)
    o = c.heads(name + "bmm2", H, v, rank, at, rank + 2, weight=w_uv,
                xsegs=[mc.XSeg("mla_combine", at, rank, stride=H * (rank + 2), nslot=blocks)])
    return c.gemv(name + "o", d, H * v, o, weight=attn.o_proj.weight,
                  xsegs=[mc.XSeg("gate", o, H * v, route=gate, off2=g_off)])


def random_cache(cfg, rows: int, gen: torch.Generator, room: int = 1) -> torch.Tensor:
    """A random latent cache of `rows` rows (N(0, 1), bf16) and `room` for new ones."""
    return torch.cat([torch.randn(rows, cfg.latent_dim, generator=gen), torch.zeros(room, cfg.latent_dim)]).bfloat16()


def layers_chain(model, layers: list[int], slot_bytes: int = 65536, packed_out: bool = False, min_tiles: int = 0,
                 routed_rows: int = mc.MAX_ROWS, kda: bool = False, seed: int = 0, mla_standins: bool = False,
                 head: bool = False, attnres: bool = False, mla_cache: int = 0, mla: int = 0,
                 mla_room: int = 1, router_first: bool = False, attn_heads: int = mc.ATTN_HEADS,
                 g_apart: bool = False, mla_g_apart: bool = False) -> mc.Chain:
    """The sublayers of `layers` as one chain, with the model's weights (an unpacked model: the weights are read
    from its modules as loaded). The first sublayer reads the chain's external input; each later one the output of
    the one before (no AttnRes: `docs/megakernel.md`, "Next"). Layer 0's MLP is dense (`dense_sublayer`), every
    other layer's is a MoE (seven phases, below).

    The output projections: by default two phases, the shared experts' down projection ("shared_down", its x ready
    once "proj" is: it runs while the top-k and the routed experts wait) and the routed up projection ("up", on the
    normalised combine); their two fp32 outputs are added where the next phase loads them (`dep2`), so a sublayer's
    output is bf16(up + shared_down). packed_out: one phase "out" over [u | h] as the compile backend packs it
    (one fp32 sum over both: bit for bit its arithmetic, but the shared part then waits for the routed one).
    min_tiles (`Chain`): phases with fewer tiles get smaller ones (the number of blocks: the up projection's 64
    tiles become 128); routed_rows: the routed experts' rows per tile at most. kda: each KDA layer's attention
    sublayer before its MLP (`kda_sublayer`; its state from `kda_start` with `seed`). mla_standins: each MLA
    layer's attention as `mla_standin` (random weights: not the model's); without it the MLA layers contribute their
    MoE only. head: the final RMSNorm (an x recipe) and the LM head after the last layer. attnres: Block AttnRes as
    the model computes it (`Chain.mix` before every sublayer and the head, the sealed rows as the model seals them;
    every layer, from 0, in order): the chain is then the model's decode step (the MLA layers as stand-ins). The
    "mix" phases are emulated only: chain.cu does not run them yet. mla_cache > 0: each MLA layer's attention as an
    emulated "mla" phase (`Chain.mla`: the model's own decode, chain.cu does not run it) over a random latent
    cache of that many rows (seeded by `seed`), instead of stand-ins. mla > 0: each MLA layer's attention as chain.cu
    runs it (`mla_sublayer`) over a random cache of that many rows (`random_cache`), with room for `mla_room` new rows
    (the tiles hold mla + mla_room keys: `greedy_steps` decodes that many tokens). router_first (with attnres):
    the router's rows in proj right after the latent down projection's, not last, so that they are in the phase's
    first round of tiles (each block's first) and the top-k can choose while the shared experts' rows stream
    (`docs/megakernel.md`, "Next (12-03, afternoon)"); the same outputs, in another place of proj's words.
    attn_heads: the MLA attention's heads a tile (`Chain.attn`; a build with -DATTN_HEADS=attn_heads runs it).
    g_apart (with attnres): each KDA layer's gate rows a phase of their own beside the step (`kda_sublayer`);
    mla_g_apart (with attnres and mla): each MLA layer's beside the attention (`mla_sublayer`)."""
    cfg = model.config
    if not (cfg.latent_moe_use_norm and cfg.num_shared_experts):
        raise ValueError("layers_chain builds LatentMoE with its latent norm and shared experts (every K3 preset)")
    d, E, K = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token
    L, I = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    Is = I * cfg.num_shared_experts
    beta, lb = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    if attnres and layers != list(range(cfg.num_hidden_layers)):
        raise ValueError(f"attnres: the chain is the model's whole step, layers 0..{cfg.num_hidden_layers - 1}")
    c = mc.Chain(d, slot_bytes, min_tiles=min_tiles)
    out: list[int] = []             # the last sublayer's output: the phases whose words add up to it
    gen = torch.Generator().manual_seed(seed)
    bank, p_ref, eps = [], "input", cfg.rms_norm_eps     # AttnRes: the sealed rows, the pending sum's vector

    def mixed(name: str, res_norm, res_query, norm) -> list[int]:
        """AttnRes before a sublayer: its x (the mix phase's first d words); p moves on to the mix's own."""
        nonlocal p_ref
        q = c.mix(name, d, bank, p_ref, out, res_norm.weight if bank else None, res_query.weight if bank else None,
                  norm.weight, eps, norm.eps)
        p_ref = (q, d)
        return [q]

    for l in layers:
        attn, layer = model.model.layers[l].self_attn, model.model.layers[l]
        if attnres:
            out = mixed(f"L{l}.mix.attn", layer.self_attention_res_norm, layer.self_attention_res_proj,
                        layer.input_layernorm)
            if l % cfg.attn_res_block_size == 0:         # seal after the attention mix
                bank, p_ref = bank + [p_ref], None
        if kda and not cfg.is_mla(l):
            out = [kda_sublayer(c, attn, out, f"L{l}.kda.", kda_start(attn, gen), g_apart=g_apart)]
        elif mla and cfg.is_mla(l):
            out = [mla_sublayer(c, attn, out, f"L{l}.gmla.", random_cache(cfg, mla, gen, mla_room), mla,
                                capacity=mla + mla_room, heads_tile=attn_heads, g_apart=mla_g_apart)]
        elif mla_cache and cfg.is_mla(l):
            if not attnres:
                raise ValueError("mla_cache: the emulated MLA attention is for the model's whole step (attnres)")
            cache = torch.randn(mla_cache, cfg.latent_dim, generator=gen).bfloat16()
            out = [c.mla(f"L{l}.mla.attn", out[0], attn, cache, mla_cache)]
        elif mla_standins and cfg.is_mla(l):
            out = [mla_standin(c, out, f"L{l}.mla.", cfg)]
        if attnres:
            out = mixed(f"L{l}.mix.mlp", layer.mlp_res_norm, layer.mlp_res_proj, layer.post_attention_layernorm)
        if cfg.is_dense(l):
            out = dense_sublayer(c, model.model.layers[l].mlp, out, f"L{l}.dense.")
            continue
        moe = model.model.layers[l].block_sparse_moe
        if type(moe.routed_expert_down_proj) is not torch.nn.Linear:
            raise ValueError(f"layer {l}: the model is packed; build the chain from the model as loaded")
        sh, ex, n = moe.shared_experts, moe.experts, f"L{l}.moe."
        sh_off = L                      # the shared experts' gate rows in proj
        if attnres:     # the router's rows in proj: one AttnRes x load a sublayer, not two (12-02 19:30)
            z, r, sg, su = moe.routed_expert_down_proj.weight, moe.gate.weight, sh.gate_proj.weight, sh.up_proj.weight
            parts, r_off, sh_off = ([z, r, sg, su], L, L + E) if router_first else ([z, sg, su, r], L + 2 * Is, L)
            router = proj = gemv_on(c, out, n + "proj", L + 2 * Is + E, d, torch.cat(parts))
        else:
            proj = gemv_on(c, out, n + "proj", L + 2 * Is, d, torch.cat(
                [moe.routed_expert_down_proj.weight, sh.gate_proj.weight, sh.up_proj.weight]))
            router, r_off = gemv_on(c, out, n + "router", E, d, moe.gate.weight), 0
        tk = c.topk(n + "topk", K, router, score=mc.XSeg("score", router, E, off=r_off,
                                                       aux=moe.gate.e_score_correction_bias,
                                                       renorm=cfg.moe_renormalize and K > 1,
                                                       scaling=cfg.routed_scaling_factor))
        shared_h = mc.XSeg("glu", proj, Is, off=sh_off, off2=Is, round_in=True, beta=beta, lb=lb)
        if not packed_out:
            sd = c.gemv(n + "shared_down", d, Is, proj, xsegs=[shared_h], weight=sh.down_proj.weight)
        c.max_rows = routed_rows
        gu = c.routed(n + "gate_up", tk, 2 * I, L, E, proj, weight=torch.cat([ex.w1, ex.w3], dim=1))
        down = c.routed(n + "down", tk, L, I, E, gu, per_slot=True, weight=ex.w2,
                        xsegs=[mc.XSeg("glu", gu, I, off2=I, stride=2 * I, beta=beta, lb=lb)])
        c.max_rows = mc.MAX_ROWS
        comb = mc.XSeg("combine_norm", down, L, stride=L, route=tk, nslot=K, aux=moe.routed_expert_norm.weight,
                       eps=cfg.rms_norm_eps)
        if packed_out:
            out = [c.gemv(n + "out", d, L + Is, down, weight=torch.cat([moe.routed_expert_up_proj.weight,
                                                                        sh.down_proj.weight], dim=1),
                          xsegs=[comb, shared_h])]
        else:
            out = [c.gemv(n + "up", d, L, down, xsegs=[comb], weight=moe.routed_expert_up_proj.weight), sd]
    if head and attnres:
        m = model.model
        x = mixed("final.mix", m.output_attn_res_norm, m.output_attn_res_proj, m.norm)
        gemv_on(c, x, "lm_head", cfg.vocab_size, d, model.lm_head.weight)
    elif head:
        if len(out) > 2:
            raise ValueError("the LM head after the dense layer: its norm adds two phases' words at most")
        norm = mc.XSeg("norm", out[0], d, route=out[1] if len(out) > 1 else -1, aux=model.model.norm.weight,
                       eps=cfg.rms_norm_eps)
        c.gemv("lm_head", cfg.vocab_size, d, out[0], xsegs=[norm], weight=model.lm_head.weight)
    return c


def greedy_steps(model, bufs: mc.Buffers, token: int, steps: int, step=None, follow: bool = False,
                 ref64: bool = False) -> list[dict]:
    """Greedy decoding of `steps` tokens after `token` with a whole-step chain (`layers_chain(..., attnres=True,
    head=True)`), each step's states (KDA state and conv window, the MLA caches with their new rows) carried to the
    next (`Buffers.advance`); `step()`: one launch and its checks (None: the emulation, `run_reference`). Beside it
    the model's own `forward_decode` from the same start states and caches, fed the chain's tokens: per step the
    chain's token, the model's argmax and the logits' largest difference over the largest logit. follow: the model
    restarts every step from the chain's states (each step's own error, not the two trajectories' drift apart: a
    random model amplifies bf16 differences from step to step). ref64 (with follow): also the model in fp64 on the
    CPU from the same states: each bf16 computation's largest difference from its logits over their largest ("fp64":
    kernel, model), its argmax, and each MoE layer's router keys against its own (`key_err64`, `key_errors`). On
    k3-tiny in the kernel's shapes (tests/test_megakernel_layer.py): the same token every step, the emulation's
    logits 0.003-0.042 of the largest from fp64's after a first step from random states (1.08), the model's own bf16
    0.006-0.049 (1.17)."""
    if ref64 and not follow:
        raise ValueError("ref64: the fp64 model starts from the chain's states every step (follow=True)")
    model64 = None
    if ref64:
        import copy
        model64 = copy.deepcopy(model).to("cpu", torch.float64)
    kp = [p for p, _ in bufs.kda_phases()]
    cps = sorted(bufs.chain.caches)
    L = bufs.chain.cache_len(cps[0]) if cps else 0

    def chain_states(n):
        conv = torch.stack([bufs.kda_init[p]["conv_state"] for p in kp])[:, None]
        state = torch.stack([bufs.kda_init[p]["state"] for p in kp])[:, None]
        cache = (torch.stack([bufs.cache_init[p][:n] for p in cps])[:, None] if cps
                 else torch.zeros(0, 1, 0, model.config.latent_dim, device=bufs.x.device))
        return conv, state, cache
    conv, state, cache = chain_states(L)
    out, last = [], len(bufs.chain.phases) - 1
    topks = [p for p, ph in enumerate(bufs.chain.phases) if ph.kind == "topk"]
    moes = {layer_of(bufs.chain.phases[p].name): model.model.layers[layer_of(bufs.chain.phases[p].name)]
            .block_sparse_moe for p in topks}
    seen, seen64 = {}, {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, l=l: seen.__setitem__(l, args[0].detach()[-1].float()))
             for l, m in moes.items()]
    moes64 = {l: model64.model.layers[l].block_sparse_moe for l in moes} if model64 is not None else {}
    hooks += [m.register_forward_pre_hook(lambda mod, args, l=l: seen64.__setitem__(l, args[0].detach()[-1]))
              for l, m in moes64.items()]
    try:
        for i in range(steps):
            if follow and i:
                conv, state, cache = chain_states(L + i)
            bufs.x.copy_(model.model.embed_tokens.weight[token].float())
            if step is None:
                bufs.clear()
                bufs.run_reference()
            else:
                step()
            logits = bufs.out(last).clone()
            r64 = None
            if model64 is not None:                  # (from the step's start states, before the model moves them on)
                seen64.clear()
                with torch.no_grad():
                    states64 = (t.cpu().double() for t in (conv, state, cache))
                    r64 = model64.forward_decode(torch.tensor([token]), *states64, torch.tensor([L + i]))[0][0]
            seen.clear()
            with torch.no_grad():
                ref, conv, state, rows = model.forward_decode(torch.tensor([token], device=bufs.x.device), conv,
                                                              state, cache, torch.tensor([L + i], device=bufs.x.device))
            cache = torch.cat([cache, rows.to(cache.dtype)], dim=2)
            ref = ref[0].float()
            token = int(logits.argmax())
            out.append({"step": i, "cache_len": L + i, "token": token, "model_token": int(ref.argmax()),
                        "logits_max_rel": float((logits - ref).abs().max() / ref.abs().max()),
                        "top2_gap": {"kernel": top2_gap(logits), "model": top2_gap(ref)},
                        "routes_differ": routes_differ(bufs, topks, moes, seen)})
            if r64 is not None:
                rel64 = lambda v: float((v.double().cpu() - r64).abs().max() / r64.abs().max())
                out[-1].update(fp64={"kernel": rel64(logits), "model": rel64(ref)}, fp64_token=int(r64.argmax()),
                               key_err64=key_errors(bufs, topks, moes, seen, moes64, seen64))
            if i + 1 < steps:
                bufs.advance()
    finally:
        for h in hooks:
            h.remove()
    return out


def top2_gap(logits: torch.Tensor) -> float:
    """The two largest logits' difference over the largest's magnitude (a near tie flips the argmax)."""
    v = logits.float().topk(2).values
    return float((v[0] - v[1]) / v[0].abs().clamp_min(1e-30))


def routes_differ(bufs: mc.Buffers, topks: list[int], moes: dict, seen: dict) -> list[dict]:
    """The MoE layers whose experts the kernel (or its emulation) chose differently from the model's router on the
    model's own router input (`seen`: layer -> x [d]), each with the kernel's own margin at the cut: its k-th and
    (k+1)-th largest biased scores' difference, and the k-th itself (`kernel_cut`), as a report of how close the
    tie was. Whether the kernel's router is right is `key_errors`' question: a margin alone has been 0.64 and 1.12
    bf16 steps at flips that the keys' error from fp64 explains."""
    res = []
    for p in topks:
        ph, l = bufs.chain.phases[p], layer_of(bufs.chain.phases[p].name)
        if l not in seen:
            continue
        kern = sorted(int(e) for e in bufs.out(p)[:ph.ne].tolist())
        model_ids = sorted(route_ids(moes[l], seen[l].to(moes[l].gate.weight.device)))
        if kern != model_ids:
            keys = bufs.x_of(p)[:ph.xlen].float().sort(descending=True).values
            res.append({"layer": l, "kernel_only": sorted(set(kern) - set(model_ids)),
                        "model_only": sorted(set(model_ids) - set(kern)),
                        "kernel_margin": float(keys[ph.ne - 1] - keys[ph.ne]), "kernel_cut": float(keys[ph.ne - 1])})
    return res


def router_keys(moe, x: torch.Tensor) -> torch.Tensor:
    """The keys a model's router ranks for x [d] (`router_scores` plus the bias, as `route` ranks them; fp32, or
    fp64 for the fp64 model)."""
    from k3export.plugins.moe.naive import router_scores
    s = router_scores(x[None], moe.gate.weight.to(x.device))[0]
    return s + moe.gate.e_score_correction_bias.to(x.device, s.dtype)


def key_errors(bufs: mc.Buffers, topks: list[int], moes: dict, seen: dict, moes64: dict, seen64: dict) -> dict:
    """Per MoE layer, how far the kernel's router keys (its top-k's x) and the model's (`seen`: its own router input)
    are from the fp64 model's (`seen64`), each the largest absolute difference over the experts: {layer: {"kernel":
    ..., "model": ...}}. A route the kernel picks otherwise than the model is a tie at their precision when the
    kernel's keys are as close to fp64's as the bf16 model's own are."""
    res = {}
    for p in topks:
        ph, l = bufs.chain.phases[p], layer_of(bufs.chain.phases[p].name)
        if l not in seen or l not in seen64:
            continue
        k64 = router_keys(moes64[l], seen64[l].double().cpu())
        kern = bufs.x_of(p)[:ph.xlen].double().cpu()
        model = router_keys(moes[l], seen[l]).double().cpu()
        res[l] = {"kernel": float((kern - k64).abs().max()), "model": float((model - k64).abs().max())}
    return res


def load_model_state(bufs: mc.Buffers, model, state, b: int = 0) -> int:
    """Sequence b of a model's `K3State` (after its prefill) into the chain's layouts, as where the next launch starts:
    each KDA layer's state and conv window (`kda_init`: `clear` puts them into the state's tiles and both copies of
    the window), each MLA layer's cache rows [:length] (`cache_init`), and the attention's key count
    (`set_cache_len`). Returns the sequence's length (the next token's position)."""
    L = int(state.lengths[b])
    for p, ph in bufs.kda_phases():
        s = model.state_slot[layer_of(ph.name)]
        bufs.kda_init[p] = {"state": state.kda_state[s, b].float().contiguous(),
                            "conv_state": state.kda_conv[s, b].to(torch.bfloat16).contiguous()}
    for p in bufs.chain.caches:
        if L > bufs.cache_init[p].shape[0]:
            raise ValueError(f"{bufs.chain.phases[p].name}: the sequence has {L} rows; the chain's cache holds "
                             f"{bufs.cache_init[p].shape[0]}")
        bufs.cache_init[p][:L] = state.mla_cache[model.state_slot[layer_of(bufs.chain.phases[p].name)], b, :L]
    bufs.set_cache_len(L)
    bufs.clear()
    return L


def greedy_run(preset: str, steps: int, mla: int = 1024, room: int = 40, seed: int = 0, token: int = 11,
               follow: bool = False, prefill: int = 0, ref64: bool = False) -> dict:
    """`greedy_steps` with the kernel (`RECIPES=1 MMA_ONLY=1`): a random `preset` model's whole step, everything real,
    over random MLA caches of `mla` rows with room for `room` more (past the first key blocks' some stay empty),
    `steps` tokens. Each launch is checked against the emulation of its phases on its own inputs (raises unless
    they agree as `run` requires); then the tokens against the model's own decode, fed the kernel's tokens.
    prefill > 0: instead of random states and caches, the model's eager prefill of that many random tokens, loaded
    into the kernel's layouts (`load_model_state`), the first token its last logits' argmax."""
    from k3export.bench.fp8 import gpu_random_model
    from k3export.config import PRESETS
    cfg = PRESETS[preset]
    model = gpu_random_model(cfg, seed)
    chain = layers_chain(model, list(range(cfg.num_hidden_layers)), kda=True, seed=seed, head=True, attnres=True,
                         mla=mla, mla_room=room, min_tiles=torch.cuda.get_device_properties(0).multi_processor_count)
    bufs = mc.Buffers(chain)
    if prefill:
        if prefill > mla + room:
            raise ValueError(f"prefill {prefill}: the chain's caches hold {mla + room} rows (--mla, room)")
        prompt = torch.randint(0, cfg.vocab_size, (1, prefill), device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(seed + 2))
        state = model.new_state(1, prefill + steps)
        with torch.no_grad():
            token = int(model.prefill(prompt, state)[0, -1].argmax())
        load_model_state(bufs, model, state)
    kern = mc.ChainKernel(defines=DEFINES)
    kern.bind(bufs)
    checks = []

    def step():
        bufs.clear()
        kern.launch("stream", dump=True)
        kern.check()
        e = bufs.errors()
        e["recipe_x"] = rx = bufs.recipe_errors()
        differ = sum(v["differ"] for v in rx.values())
        checks.append({"max_rel": e["max_rel"], "recipe_x_differ": differ, "topk_wrong": e["topk_wrong"],
                       "kda_out_of_bounds": e["kda_out_of_bounds"], "mix_out_of_bounds": e.get("mix_out_of_bounds")})
        if bufs.failed(e) or differ:
            raise RuntimeError(f"step {len(checks) - 1}: the kernel differs from the emulation of its phases: {e}")
    res = greedy_steps(model, bufs, token, steps, step, follow=follow, ref64=ref64)
    for r, c in zip(res, checks):
        r["check"] = c
        print(f"step {r['step']}: cache_len {r['cache_len']}, token {r['token']} (model {r['model_token']}), logits "
              f"within {r['logits_max_rel']:.4f} of the model's; top-2 gap {r['top2_gap']}; routing differs "
              f"{r['routes_differ'] or 'nowhere'}; " + (f"against fp64 {r['fp64']} (its token {r['fp64_token']}); "
                                                        if "fp64" in r else "") + f"checks {c}", flush=True)
    return {"device": torch.cuda.get_device_name(0), "preset": preset, "mla": mla, "room": room, "follow": follow,
            "prefill": prefill, "steps": res}


# the phases whose output is a sublayer's (and the dense MLP's last "down.N")
OUTPUTS = (".out", ".up", ".kda.o", ".mla.o", ".gmla.o", ".mla.attn", "lm_head")


def sublayer_phases(bufs: mc.Buffers) -> list[int]:
    """Each sublayer's output phase, in chain order."""
    ph = bufs.chain.phases
    return [p for p, f in enumerate(ph) if f.name.endswith(OUTPUTS) or (
        ".dense.down." in f.name and (p + 1 == len(ph) or ".dense.down." not in ph[p + 1].name))]


def outputs(bufs: mc.Buffers) -> list[torch.Tensor]:
    """Each sublayer's output in fp32, in chain order: its "out" (or KDA "o", ...) phase's, or its "up" and
    "shared_down" phases' added, or the dense MLP's down parts added in order (as the next phase's x load adds
    them)."""
    ph, res = bufs.chain.phases, []
    for p in sublayer_phases(bufs):
        if ph[p].name.endswith(".up"):
            sd = next(q for q, f in enumerate(ph) if f.name == ph[p].name[:-3] + ".shared_down")
            res.append(bufs.out(p) + bufs.out(sd))
        elif ph[p].name.endswith(".mla.attn"):
            res.append(bufs.out(p)[:bufs.chain.x_len])
        elif ".dense.down." in ph[p].name:
            q = p - int(ph[p].name.rsplit(".", 1)[1])
            y = bufs.out(q)
            for r in range(q + 1, p + 1):
                y = y + bufs.out(r)
            res.append(y)
        else:
            res.append(bufs.out(p))
    return res


def layer_of(name: str) -> int:
    """The layer of a phase named "L<layer>.<...>"."""
    return int(name.split(".")[0][1:])


def chosen(bufs: mc.Buffers) -> list[list[int]]:
    """Each sublayer's chosen experts, in slot order."""
    return [bufs.out(p)[:ph.ne].long().tolist() for p, ph in enumerate(bufs.chain.phases) if ph.kind == "topk"]


def sublayer_inputs(bufs: mc.Buffers) -> list[torch.Tensor]:
    """The bf16 input of each sublayer as the kernel read it: the external x, then each previous output; with
    AttnRes, the x of the mix before it (normalised: the sublayer's own norm is in the mix)."""
    ph, d = bufs.chain.phases, bufs.chain.x_len
    if bufs.chain.mixes:
        return [bufs.out(max(q for q in bufs.chain.mixes if q < p))[:d].bfloat16() for p in sublayer_phases(bufs)]
    return [bufs.x.bfloat16()] + [y.bfloat16() for y in outputs(bufs)[:-1]]


def kda_vs_triton(bufs: mc.Buffers, p: int) -> dict:
    """After a check launch that followed `clear` (GPU): KDA phase p and its head norm (the x of the phase after it)
    against the KDA plugin's Triton kernel (`k3::kda_decode_inplace`, as `compile` runs it, but given f as the
    kernel sums it: `kda_fold_k3`) on the kernel's own inputs: output elements that differ (bf16), the new state's
    (fp32) and the new conv window's."""
    a = bufs.kda_inputs(p)
    seg = bufs.chain.xsegs[bufs.chain.phases[p].xop]
    H, K = seg.nslot, mc.KDA_HEAD
    q = next(q for q, ph in enumerate(bufs.chain.phases) if ph.xop >= 0 and bufs.chain.xsegs[ph.xop].op == "headnorm"
             and bufs.chain.xsegs[ph.xop].src == p)
    norm = bufs.chain.xsegs[bufs.chain.phases[q].xop]
    g = bufs.out(norm.route)[norm.off2:norm.off2 + H * K]
    conv, state = a["conv_state"].clone()[None], a["state"].clone()[None]
    f = mc.kda_fold_k3(a["f_a"], a["f_b"])
    o = torch.ops.k3.kda_decode_inplace(a["qkv"].bfloat16()[None], conv, a["conv_weight"], f.bfloat16()[None], None,
                                        a["b"].bfloat16()[None], g.bfloat16()[None], a["a_log"], a["dt_bias"],
                                        bufs.aux[bufs.chain.phases[q].xop], state, a["lb"], norm.eps)
    ds = (bufs.kda_state(p) - state[0]).abs()
    return {"o": compare(bufs.xdump[q, 0, :H * K], o[0]), "state_differ": int((ds > 0).sum()),
            "state_max_rel": float(ds.max() / state.abs().max()),
            "conv_differ": int((bufs.kda_conv(p) != conv[0]).sum())}


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Two bf16 vectors: how many elements differ, the largest difference in units of b's bf16 spacing there, and
    the largest |a - b| / max |b|."""
    a, b = a.float(), b.float()
    diff = (a - b).abs()
    ulp = torch.where(b == 0, torch.full_like(b, 2.0 ** -133), 2.0 ** (torch.floor(torch.log2(b.abs())) - 7))
    return {"differ": int((diff > 0).sum()), "of": a.numel(), "max_ulps": float((diff / ulp).max()),
            "max_rel": float(diff.max() / b.abs().max().clamp_min(1e-30))}


def parts_vs_compile(bufs: mc.Buffers, layer_index: int, moe, x: torch.Tensor) -> dict:
    """Where a sublayer's output differs from the compile backend's: its intermediate vectors, each from the same x,
    kernel (after a check launch: its outputs and recipe x) against the model's packed MoE. z: the latent down
    projection; shared_h: the shared experts' SiTU-GLU; u: the routed experts' combine (the kernel's from its fp32
    expert rows and weights, rounded as its recipe does); latent_normed: RMSNorm(u)."""
    ph = bufs.chain.phases
    p_out = [p for p, f in enumerate(ph) if f.name.endswith((".out", ".up"))][layer_index]
    packed = ph[p_out].name.endswith(".out")
    at = {f.name: q for q, f in enumerate(ph)}
    base = ph[p_out].name.rsplit(".", 1)[0]
    p_proj, p_topk, p_down = at[base + ".proj"], at[base + ".topk"], at[base + ".down"]
    comb = bufs.chain.xsegs[ph[p_out].xop]
    L, K = comb.len, ph[p_topk].ne
    w, rows = bufs.out(p_topk)[K:2 * K], bufs.out(p_down).view(K, L)
    u_k = torch.zeros(L, device=rows.device)
    for s in range(K):
        u_k = mc.fma32(w[s].expand(L), rows[s], u_k)
    z, h = moe.project_hidden(x[None])
    u = moe.routed(x[None], z)
    xk = bufs.xdump[p_out, 0, :ph[p_out].k]
    hk = xk[L:] if packed else bufs.xdump[at[base + ".shared_down"], 0, :ph[at[base + ".shared_down"]].k]
    return {"z": compare(bufs.out(p_proj)[:L].bfloat16(), z[0]), "shared_h": compare(hk, h[0]),
            "u": compare(u_k.bfloat16(), u[0]), "latent_normed": compare(xk[:L], moe.routed_expert_norm(u)[0])}


def product_mlps(model, layers: list[int]):
    """The model's MLP modules (MoE, or layer 0's dense MLP) as the `compile` backend runs them at B = 1: its
    constructor packs the model in place (paired experts, packed projections, k3::gemv), so build the chain
    first."""
    from k3export.runtime import CompileBackend
    CompileBackend(model)
    return [model.model.layers[l].mlp if model.config.is_dense(l) else model.model.layers[l].block_sparse_moe
            for l in layers]


def route_ids(moe, x: torch.Tensor) -> list[int]:
    """The experts the model's router picks for x [d] (plain torch, fp32; plugins/moe/naive.py `route`)."""
    from k3export.plugins.moe.naive import route
    r = moe.routing
    ids, _ = route(x[None], moe.gate.weight, moe.gate.e_score_correction_bias, r["top_k"], r["renormalize"],
                   r["scaling"])
    return ids[0].tolist()


DIAGNOSTICS = ("SKIP_COMPUTE", "NOLOADX", "NOCOPY")     # chain.cu builds whose outputs are wrong by design


def run(preset: str, layers: list[int] | None, rounds: int, iters: int, seed: int = 0,
        defines: tuple[str, ...] = DEFINES, modes: tuple[str, ...] = ("stream", "serial", "nodeps"),
        baseline: bool = True, cu: Path = mc.CU, packed_out: bool = False, spread: bool = True,
        routed_rows: int = mc.MAX_ROWS, kda: bool = True, mla_standins: bool = False, head: bool = False,
        attnres: bool = False, context: int = 1024, mla: int = 0, router_first: bool = False,
        attn_heads: int = mc.ATTN_HEADS, g_apart: bool = False, mla_g_apart: bool = False) -> dict:
    """Check (unless a diagnostic build), compare with the compile backend and time (`baseline`), time `modes`.
    A -DTRACE_TILES build also reports what each block's ring did in one stream launch (`tile_pipeline`). The
    compile baseline runs the chain's real sublayers (the MLA stand-ins have no counterpart there, nor AttnRes; the
    real MLA attention is the model's decode over the same cache);
    with attnres (the whole step), also the `compile` engine's whole real decode step at B = 1 after `context`
    tokens ("compile step"). mla > 0: the MLA attention real (`mla_sublayer`), over random caches of that many rows,
    each checked against the model's own decode on the kernel's input and cache."""
    from k3export.bench.ceilings import copy_bandwidth, graph_replay
    from k3export.bench.fp8 import gpu_random_model
    from k3export.config import PRESETS
    from k3export.plugins.launch import pdl
    cfg = PRESETS[preset]
    mla_standins = mla_standins and not mla         # (the real MLA attention replaces the stand-ins)
    model = gpu_random_model(cfg, seed)
    layers = layers or moe_layers(cfg)
    blocks = torch.cuda.get_device_properties(0).multi_processor_count
    chain = layers_chain(model, layers, packed_out=packed_out, min_tiles=blocks if spread else 0,
                         routed_rows=routed_rows, kda=kda, seed=seed, mla_standins=mla_standins and not mla,
                         head=head, attnres=attnres, mla=mla, router_first=router_first, attn_heads=attn_heads,
                         g_apart=g_apart, mla_g_apart=mla_g_apart)
    bufs = mc.Buffers(chain)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    bufs.x.copy_(torch.randn(cfg.hidden_size, generator=g, device="cuda").bfloat16().float())
    kern = mc.ChainKernel(defines=tuple(dict.fromkeys(DEFINES + tuple(defines))), cu=cu)
    diagnostic = bool(set(DIAGNOSTICS) & set(kern.defines))
    kern.bind(bufs)
    res = {"device": torch.cuda.get_device_name(0), "preset": preset, "layers": layers, "kda": kda,
           "mla_standins": mla_standins, "head": head, "packed_out": packed_out, "spread": spread,
           "routed_rows": routed_rows, "attnres": attnres, "mla": mla, "router_first": router_first,
           "g_apart": g_apart, "mla_g_apart": mla_g_apart, "phases": len(chain.phases), "tiles": chain.ntiles, "bytes_read": chain.bytes_read,
           "copy_gbs": copy_bandwidth() / 1e9, "defines": list(kern.defines), "check": {}}
    # 1. the kernel against the torch emulation of its phases (stream and serial: the same outputs)
    for m in () if diagnostic else ("stream", "serial"):
        bufs.clear()
        kern.launch(m, dump=True)
        kern.check()
        e = bufs.errors()
        e["recipe_x"] = rx = bufs.recipe_errors()
        e["kda_vs_triton"] = {bufs.chain.phases[p].name: kda_vs_triton(bufs, p) for p, _ in bufs.kda_phases()}
        res["check"][m] = e
        worst = max(e["max_rel"].values())
        attn = f" (attention {e['max_rel']['attn']:.2e})" if "attn" in e["max_rel"] else ""
        print(f"{m}: GEMV / routed max rel {worst:.2e}{attn}; top-k differing {e['topk_wrong']}; unwritten "
              f"{e['unwritten']}; recipe x elements differing "
              f"{sum(v['differ'] for v in rx.values())} of {sum(v['of'] for v in rx.values())}", flush=True)
        for name, v in e["kda"].items():
            print(f"  {name}: vs emulation {v}; vs Triton {e['kda_vs_triton'][name]}", flush=True)
        if e.get("mix"):
            mx = e["mix"].values()
            print(f"  AttnRes ({len(mx)} mixes) vs emulation: p differing {sum(v['p_differ'] for v in mx)}, x "
                  f"differing {sum(v['x_differ'] for v in mx)} of {len(mx) * chain.x_len}, at most "
                  f"{max(v['x_max_ulps'] for v in mx):g} bf16 steps", flush=True)
        if bufs.failed(e):
            raise RuntimeError(f"{m}: the kernel differs from the emulation of its phases, not timing it: {e}")
    # 2. each sublayer against the model's MoE as the compile backend runs it, on the kernel's input (not for a
    # diagnostic build: its outputs are wrong by design)
    mlps = product_mlps(model, layers) if baseline else []
    attns = {l: model.model.layers[l].self_attn for l in layers if kda and not cfg.is_mla(l)}
    kda_p = {layer_of(ph.name): p for p, ph in bufs.kda_phases()}     # layer -> its KDA phase
    kids = [] if diagnostic or not baseline else chosen(bufs)      # (each MoE sublayer's experts)
    res["vs_compile"] = []
    with torch.no_grad(), pdl(True, early=True):
        subs = list(zip(sublayer_phases(bufs), sublayer_inputs(bufs), outputs(bufs)))
        moe_i = 0
        for p, x, y in [] if diagnostic or not baseline else subs:
            name = chain.phases[p].name
            y, l = y.bfloat16(), None if name == "lm_head" else layer_of(name)
            if name.endswith(".mla.o"):                         # (a stand-in: nothing to compare)
                continue
            if name.endswith(".gmla.o"):        # the model's own MLA decode on the kernel's input and cache
                cp = next(q for q in chain.caches if layer_of(chain.phases[q].name) == l)
                L = chain.cache_len(cp)
                ref, new = model.model.layers[l].self_attn.decode(
                    x[None], bufs.cache_init[cp][:L][None], torch.tensor([L], device=x.device))
                row = dict(layer=l, sublayer="mla", **compare(y, ref[0]),
                           new_row=compare(bufs.cache[cp][L], new[0]))
                res["vs_compile"].append(row)
                print(f"L{l}: {row}", flush=True)
                continue
            if name == "lm_head":                               # the final norm and the LM head
                xn = x[None] if chain.mixes else model.model.norm(x[None])     # (AttnRes: normalised in the mix)
                row = dict(layer="head", sublayer="lm_head", **compare(y, model.lm_head(xn)[0]))
            elif ".dense.down." in name:
                row = dict(layer=l, sublayer="dense", **compare(y, mlps[layers.index(l)](x[None])[0]))
            elif name.endswith(".kda.o"):       # the sublayer as compile runs it, from the same state
                init = bufs.kda_init[kda_p[l]]
                conv, state = init["conv_state"].clone()[None], init["state"].clone()[None]
                ref = attns[l].decode_(x[None], conv, state)[0]
                ds = (bufs.kda_state(kda_p[l]) - state[0]).abs()
                row = dict(layer=l, sublayer="kda", **compare(y, ref), state_differ=int((ds > 0).sum()),
                           state_max_rel=float(ds.max() / state.abs().max()),
                           conv_differ=int((bufs.kda_conv(kda_p[l]) != conv[0]).sum()))
            else:
                moe, kid = mlps[layers.index(l)], kids[moe_i]
                ref = moe(x[None])[0]
                row = dict(layer=l, sublayer="moe", **compare(y, ref),
                           same_experts=sorted(kid) == sorted(route_ids(moe, x)),
                           parts=parts_vs_compile(bufs, moe_i, moe, x))
                moe_i += 1
            res["vs_compile"].append(row)
            print(f"L{l}: {row}", flush=True)
    # 3. timing: the persistent launch (modes) against a CUDA graph of the compile backend's sublayers (the KDA
    # ones on their own copies of the start state, updated in place as the kernel's are)
    kda_state = {l: (bufs.kda_init[p]["conv_state"].clone()[None], bufs.kda_init[p]["state"].clone()[None])
                 for l, p in kda_p.items()}

    mla_in = {layer_of(chain.phases[p].name): (model.model.layers[layer_of(chain.phases[p].name)].self_attn,
                                                bufs.cache_init[p][:chain.cache_len(p)][None].clone(),
                                                torch.tensor([chain.cache_len(p)], device="cuda"))
              for p in chain.caches}           # (the real MLA attention: the model's decode, its cache)

    def stack(x):
        for l, mlp in zip(layers, mlps):
            if l in attns:
                x = attns[l].decode_(x, *kda_state[l])
            if l in mla_in:
                x = mla_in[l][0].decode(x, *mla_in[l][1:])[0]
            x = mlp(x)
        return model.lm_head(model.model.norm(x)) if head else x
    fns = {m: (lambda m=m: kern.launch(m)) for m in modes}
    if baseline:
        compiled = torch.compile(stack, dynamic=False)
        x0 = bufs.x.bfloat16()[None].clone()
        try:
            with torch.no_grad(), pdl(True, early=True):
                fns["compile"] = graph_replay(lambda: compiled(x0), warmup=3)
        except Exception as exc:        # (the kernel's own timing still runs; the log says why there is no baseline)
            res["baseline_error"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"compile baseline failed, timing the kernel alone: {res['baseline_error']}", flush=True)
    if baseline and attnres:            # the compile engine's whole real step (its own copy of the model)
        from k3export.runtime import CompileBackend, Engine
        eng = Engine(CompileBackend(gpu_random_model(cfg, seed)), max_batch=1,
                     max_len=context + 64 + rounds * (iters + 16))          # (each timed call decodes a token)
        if eng.graphed:
            tok = torch.randint(0, cfg.vocab_size, (1,), device="cuda")
            eng.fill_slots(context)
            eng.decode(tok)
            fns["compile step"] = lambda: eng.decode(tok)
        else:
            res["baseline_error"] = f"compile step not graphed: {eng.graph_error}"
    times = {k: [] for k in fns}
    res["round_medians_ms"] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = mc.events_ms(fn, iters)
            times[k] += t
            res["round_medians_ms"][k].append(statistics.median(t))
        kern.check()
        print("round: " + ", ".join(f"{k} {v[-1]:.4f} ms" for k, v in res["round_medians_ms"].items()), flush=True)
    res["ms"] = {k: statistics.median(v) for k, v in times.items()}
    res["bytes_floor_ms"] = chain.bytes_read / (res["copy_gbs"] * 1e6)
    kern.launch(modes[0])
    res["timeline_us"] = kern.timeline_us()
    if "PHASE_TIMES" in kern.defines:
        if kern.trace is not None:
            kern.trace.zero_()
        res["phase_times_us"] = pt = kern.phase_times(modes[0])
        before = phase_before(chain.phases, pt["done"])
        for kind in ("kda.in", "kda.o", "moe.proj", "router", "topk", "shared_down", "gate_up", "down", "up",
                     "out", "gmla.proj", "gmla.q_b", "gmla.bmm1", "gmla.attn", "gmla.bmm2", "gmla.o"):             # (a KDA step records when it began and finished only)
            ps = [p for p, f in enumerate(chain.phases) if f.name.endswith("." + kind) and before[p] >= 0][1:-1]
            if ps:                  # (us after the phases it waits for finished, `phase_before`; mean over layers)
                after = lambda key: statistics.fmean(pt[key][p] - pt["done"][before[p]] for p in ps)
                print(f"{kind}: after the phases before it finished, began {after('begin'):+.1f} us, had x "
                      f"{after('x'):+.1f} us, a tile {after('tile'):+.1f} us, done {after('done'):+.1f} us",
                      flush=True)
                if "blocks" in pt:      # -DBLOCK_TIMES: over the phase's blocks, first / median / last
                    print("    " + block_spread(pt, ps, before), flush=True)
                if "blocks" in pt and kind == "gmla.attn" and kern.trace is not None:   # (+ -DTRACE)
                    print("    " + attn_x_parts(kern, chain, pt, before), flush=True)
                elif "blocks" in pt and kern.trace is not None:
                    print("    " + x_load_parts(trace_units(kern), ps, pt, before), flush=True)
    if kern.tile_trace is not None:
        tp = res["tile_pipeline"] = kern.tiles_traced(modes[0])
        print("tiles: " + json.dumps({k: v for k, v in tp.items() if k != "landed_tbs"}), flush=True)
    res["phase_names"] = [p.name for p in chain.phases]
    res["phase_bytes"] = [p.bytes_read for p in chain.phases]
    return res


def phase_before(phases: list, done: list[float]) -> dict[int, int]:
    """Per phase, the one its times are read after: of the phases with tiles since the last one dealt over the whole
    grid (that one included), the last to finish. A phase dealt beside another (`spare`, a gate) sits between a
    sublayer's phases in the table without being what the next one waits for; taking the phase just before would
    time the attention's BMM2 after the MLA gate (12-04: "11 us" that were 2.3-3.7 after the attention). -1: none."""
    out = {}
    for p in range(len(phases)):
        near = []
        for q in range(p - 1, -1, -1):
            if phases[q].ntiles:
                near.append(q)
                if not phases[q].spare:
                    break
        out[p] = max(near, key=lambda q: done[q] if done[q] == done[q] else float("-inf"), default=-1)
    return out


def _spread(per: list[tuple[float, float, float]]) -> str:
    """Per phase (first, median, last) block: their means over the phases, "a / b / c"."""
    return " / ".join(f"{statistics.fmean(c):+.1f}" for c in zip(*per))


def _first_median_last(v: list[float]) -> tuple[float, float, float]:
    v = sorted(v)
    return v[0], v[(len(v) - 1) // 2], v[-1]


def block_spread(pt: dict, ps: list[int], before: dict) -> str:
    """A -DBLOCK_TIMES run's phases ps (one kind, a layer each): when their blocks had x, had the first tile and were
    done, us after the phase before finished: the first, median and last block, means over the phases."""
    out, nblk = [], 0
    for key in ("x", "tile", "done"):
        per = []
        for p in ps:
            v = [b[p] - pt["done"][before[p]] for b in pt["blocks"][key] if b[p] == b[p]]
            if v:
                per.append(_first_median_last(v))
                nblk = max(nblk, len(v))
        if per:
            out.append(f"{key} {_spread(per)}")
    return f"blocks (up to {nblk}): " + ", ".join(out) + " us (first / median / last)"


def attn_x_parts(kern, chain, pt: dict, before: dict) -> str:
    """A -DPHASE_TIMES -DBLOCK_TIMES -DTRACE run: when each block's thread 0 had each part of its first ATTN x load
    (the queries, the new row's RMSNorm, its pe words) and reached each part of its first tile (begun: its weights
    in the ring; the scores; the softmax; done, its words stored), us after the phase before finished: the first,
    median and last block, means over the attention phases."""
    ps = [p for p, f in enumerate(chain.phases) if f.kind == "attn"]
    tr = kern.trace.view(kern.blocks, mc.TRACE_UNITS, mc.TRACE_FIELDS).cpu()
    t0 = int(kern.t_start.cpu())
    names = ("queries", "new row norm", "new row pe", "tile begun", "scores", "softmax", "tile done",
             "again: begun", "scores", "softmax", "done")                    # (the last four: -DATTN_TWICE)
    per = {q: [] for q in range(len(names))}         # (the times; the fields past them are SM clocks)
    for a, p in enumerate(ps):
        unit = tr[:, mc.TRACE_UNITS - 1 - a]
        for q in per:
            v = [(int(x) - t0) / 1e3 - pt["done"][before[p]] for x in unit[:, q] if int(x)]
            if v:
                per[q].append(_first_median_last(v))
    # the SM clock over the first tile, from clock64 at its begun and done ([11], [12]) against %globaltimer
    mhz = [float(r[12] - r[11]) / float(r[6] - r[3]) * 1e3 for a in range(len(ps))
           for r in tr[:, mc.TRACE_UNITS - 1 - a].tolist() if r[3] and r[6] > r[3] and r[12] > r[11]]
    return "x and tile parts: " + ", ".join(f"{names[q]} {_spread(per[q])}" for q in per if per[q]) + \
        " us (first / median / last block)" + \
        (f"; SM clock over the tile {_spread([_first_median_last(mhz)])} MHz" if mhz else "")


def trace_units(kern) -> dict[int, list[list[int]]]:
    """A -DTRACE run's generic trace units (`chain.cu` TRACE_FIELDS): per phase, each block's first unit for it (its
    fields, ns after the launch began; 0: not reached)."""
    tr = kern.trace.view(kern.blocks, mc.TRACE_UNITS, mc.TRACE_FIELDS).cpu().tolist()
    t0 = int(kern.t_start.cpu())
    out: dict[int, list[list[int]]] = {}
    for b in range(kern.blocks):
        seen = set()
        for u in tr[b][:mc.TRACE_UNITS - 4]:
            p = int(u[16]) - 1
            if p < 0 or p in seen:
                continue
            seen.add(p)
            out.setdefault(p, []).append([int(x) - t0 if 0 < int(x) and q < 16 else 0 for q, x in enumerate(u)])
    return out


X_PARTS = {"begun": (0,), "synced": (3,), "words": (4,), "all words": (5,), "normed": (6,),
           "made": (10, 11, 12, 13, 14, 15), "in shared": (1,), "tile": (2,)}
TOPK_PARTS = {"begun": (0,), "synced": (3,), "scores": (4,), "all scores": (5,), "ranked": (6,), "all ranked": (7,),
              "made": (10,), "in shared": (1,), "tile": (2,)}
ATTNRES_PARTS = {"begun": (0,), "synced": (3,), "old sources": (4,), "y": (5,), "sums": (6,), "scores": (11,),
                 "mix": (12,), "norm": (7,), "made": (10,), "in shared": (1,), "tile": (2,)}


def x_load_parts(units: dict, ps: list[int], pt: dict, before: dict) -> str:
    """A -DPHASE_TIMES -DBLOCK_TIMES -DTRACE run (`trace_units`): when each block's thread 0 had each part of its
    x load for the phases ps (one kind, a layer each): begun, every warp done with the last x ("synced"), its first
    part's words polled (thread 0's, then every thread's: the norm's first barrier) and normed; a top-k's scores,
    every thread's, thread 0's key ranked, every key's; an AttnRes x's old sources, y, its sums' barrier, the
    scores, the softmax and mix, the norm's barrier; then the x made, in shared memory, its first tile. us after
    the phase before finished (its warp 0), the first, median and last block, means over the phases. "source's
    warps": the last of the phase before's warps done, after its warp 0."""
    ps = [p for p in ps if p in units]
    if not ps:
        return "x load parts: no trace units"
    attnres = any(u[11] for u in units[ps[0]])      # (an AttnRes x marks its scores)
    parts = ATTNRES_PARTS if attnres else TOPK_PARTS if any(u[7] for u in units[ps[0]]) else X_PARTS
    per = {k: [] for k in parts}
    late = []
    for p in ps:
        ref = pt["done"][before[p]]
        for k, fields in parts.items():
            v = [max(u[q] for q in fields) / 1e3 - ref for u in units[p] if max(u[q] for q in fields)]
            if v:
                per[k].append(_first_median_last(v))
        src = units.get(before[p], [])
        w = [u[8] for u in src if u[8]]
        if w:
            late.append(max(w) / 1e3 - ref)
    text = "x load parts: " + ", ".join(f"{k} {_spread(v)}" for k, v in per.items() if v) + \
        " us (first / median / last block)"
    if late:
        text += f"; source's warps done {statistics.fmean(late):+.2f} us"
    return text


KIND_COLOURS = {"kda": "tab:blue", "moe": "tab:orange", "dense": "tab:green", "mla stand-in": "tab:gray",
                "mla": "tab:brown", "attnres": "tab:olive", "head": "tab:purple"}


def phase_group(name: str) -> str:
    """The sublayer kind a phase belongs to, for the plot: kda, moe, dense, mla (emulated or chain.cu's), mla stand-in,
    attnres or head."""
    if name == "lm_head":
        return "head"
    if name.endswith(".mla.attn"):
        return "mla"
    return {"kda": "kda", "moe": "moe", "dense": "dense", "mla": "mla stand-in", "gmla": "mla",
            "mix": "attnres"}[name.split(".")[1]]


def time_by_group(res: dict) -> dict:
    """us of the stream launch's timeline by sublayer kind: each phase gets the time from the phase before it
    finishing to its own finishing (the critical path's share, approximately)."""
    out, prev = {}, 0.0
    for name, t in zip(res["phase_names"], res["timeline_us"]):
        g = phase_group(name)
        out[g] = out.get(g, 0.0) + t - prev
        prev = t
    return out


def plot(res: dict, path: str, target_ms: float | None = None) -> None:
    """Left: the weight bytes of the finished phases against when they finished (one stream launch), by sublayer
    kind, beside the copy rate. Right: the launch's time by kind (`time_by_group`), with compile's time for its
    real sublayers and, if given, the target."""
    plt = mc._pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    cum, total = [], 0
    for b in res["phase_bytes"]:
        total += b
        cum.append(total / 1e6)
    groups = [phase_group(n) for n in res["phase_names"]]
    for g, colour in KIND_COLOURS.items():
        pts = [(t, c) for t, c, h in zip(res["timeline_us"], cum, groups) if h == g]
        if pts:
            ax.scatter(*zip(*pts), s=7, color=colour, label=g)
    gbs = res["copy_gbs"]
    ax.plot([0, cum[-1] * 1e3 / gbs], [0, cum[-1]], "k--", lw=0.8, label=f"copy rate {gbs / 1e3:.2f} TB/s")
    ax.set_xlabel("phase finished at (us after launch)")
    ax.set_ylabel("weight bytes of finished phases (MB)")
    ax.set_title(f"{res['preset']} layers {res['layers'][0]}-{res['layers'][-1]}: {res['phases']} phases, "
                 f"{res['bytes_read'] / 1e6:.0f} MB, stream {res['ms']['stream']:.3f} ms", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    by = time_by_group(res)
    names = [g for g in KIND_COLOURS if g in by and (by[g] or g != "attnres")]   # (AttnRes: in its consumers')
    left = 0.0
    for g in names:
        bx.barh(["kernel"], [by[g] / 1e3], left=left, color=KIND_COLOURS[g], label=f"{g} {by[g]:.0f} us")
        left += by[g] / 1e3
    if "compile" in res["ms"]:
        bx.barh(["compile"], [res["ms"]["compile"]], color="tab:red", alpha=0.6,
                label=f"compile {res['ms']['compile']:.3f} ms (the sublayers "
                      f"{'without AttnRes' if res.get('mla') else 'that are real'})")
    if "compile step" in res["ms"]:
        bx.barh(["compile step"], [res["ms"]["compile step"]], color="tab:red",
                label=f"compile engine's whole step {res['ms']['compile step']:.3f} ms")
    if target_ms:
        bx.axvline(target_ms, color="k", ls="--", lw=1, label=f"target {target_ms} ms")
    bx.set_xlabel("ms (kernel: one launch's timeline, by kind)")
    bx.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    bx.grid(alpha=0.3, axis="x")
    fig.suptitle(f"The persistent decode kernel, one launch ({res['device']})", fontsize=11)
    fig.tight_layout()
    mc._save_png(fig, path)


TARGET_MS = {"k3-small": 0.683}     # #6: k3-small decode at B = 1 within 2x of its bytes floor


def preset_layers(preset: str) -> int:
    from k3export.config import PRESETS
    return PRESETS[preset].num_hidden_layers


def parse_layers(text: str | None) -> list[int] | None:
    if not text:
        return None
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-small")
    ap.add_argument("--layers", help="MoE layers, e.g. 1-11 or 1,2 (default: every MoE layer of the preset)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--modes", default="stream,serial,nodeps")
    ap.add_argument("--defines", default="", help="more chain.cu defines, DEFINE+DEFINE=V (diagnostics: no checks)")
    ap.add_argument("--no-baseline", action="store_true", help="no compile backend comparison or timing")
    ap.add_argument("--packed-out", action="store_true", help="one output phase over [u | h], as compile packs it")
    ap.add_argument("--no-spread", action="store_true", help="tiles as large as a slot takes, however few")
    ap.add_argument("--routed-rows", type=int, default=mc.MAX_ROWS, help="the routed experts' rows per tile at most")
    ap.add_argument("--cu", type=Path, default=mc.CU, help="another version of chain.cu (an A/B)")
    ap.add_argument("--no-kda", action="store_true", help="the MoE sublayers alone (no KDA attention sublayers)")
    ap.add_argument("--step", action="store_true", help="layers 0-11 (unless --layers), MLA stand-ins, final norm and "
                    "LM head: the whole step's bytes and links, real but for the MLA attention (and AttnRes)")
    ap.add_argument("--no-standins", action="store_true", help="with --step: no MLA stand-ins")
    ap.add_argument("--attnres", action="store_true", help="with --step: Block AttnRes before every sublayer and the "
                    "head, as the model has it (in the consumers' x loads), and the compile engine's whole step timed")
    ap.add_argument("--mla", type=int, default=0, metavar="ROWS",
                    help="with --step: the MLA attention real (chain.cu's ATTN) over random caches of ROWS rows, not "
                         "stand-ins")
    ap.add_argument("--greedy", type=int, default=0, metavar="STEPS",
                    help="no timing: decode STEPS tokens greedily with the whole step in the kernel (--mla rows of "
                         "cache, default 1024), each launch checked, against the model's own decode")
    ap.add_argument("--follow", action="store_true",
                    help="with --greedy: the model restarts each step from the kernel's states (each step's own error)")
    ap.add_argument("--ref64", action="store_true",
                    help="with --greedy --follow: also the model in fp64 on the CPU from the kernel's states (how "
                         "far the kernel's and the model's bf16 logits each are from it)")
    ap.add_argument("--prefill", type=int, default=0, metavar="T",
                    help="with --greedy: start from the model's prefill of T random tokens (T <= --mla + 40), not "
                         "random states")
    ap.add_argument("--router-first", action="store_true",
                    help="with --step --attnres: each MoE's router rows right after the latent rows in its projection")
    ap.add_argument("--g-apart", action=argparse.BooleanOptionalAction, default=True,
                    help="with --step --attnres: each KDA layer's gate rows a phase of their own beside the step (the "
                         "backend's default; --no-g-apart: in the input projection)")
    ap.add_argument("--mla-g-apart", action=argparse.BooleanOptionalAction, default=True,
                    help="with --step --attnres --mla: each MLA layer's gate rows a phase of their own beside the "
                         "attention (the backend's default)")
    ap.add_argument("--out")
    ap.add_argument("--plot", help="PNG: the launch's bytes over time and its time by sublayer kind")
    ap.add_argument("--replot", metavar="JSON", help="no run: plot a saved --out result (with --plot)")
    a = ap.parse_args()
    if a.replot:
        if not a.plot:
            raise SystemExit("--replot needs --plot PNG")
        with open(a.replot) as f:
            saved = json.load(f)
        plot(saved, a.plot, TARGET_MS.get(saved["preset"]) if saved.get("head") else None)
        print(f"wrote {a.plot}")
        return
    if a.greedy:
        res = greedy_run(a.preset, a.greedy, mla=a.mla or 1024, follow=a.follow, prefill=a.prefill, ref64=a.ref64)
        agree = sum(r["token"] == r["model_token"] for r in res["steps"])
        print(f"{a.preset}: {a.greedy} greedy steps in the kernel, every launch equal to its emulation; the model's "
              f"own decode picked the same token in {agree} of {a.greedy}")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
            print(f"wrote {a.out}")
        return
    modes = tuple(a.modes.split(","))
    if not set(modes) <= set(mc.MODES):
        raise SystemExit(f"modes: choose from {', '.join(mc.MODES)}")
    layers = parse_layers(a.layers) or (list(range(preset_layers(a.preset))) if a.step else None)
    defines = tuple(d for d in a.defines.split("+") if d)
    res = run(a.preset, layers, a.rounds, a.iters, defines=defines,
              modes=modes, baseline=not a.no_baseline, cu=a.cu, packed_out=a.packed_out, spread=not a.no_spread,
              routed_rows=a.routed_rows, kda=not a.no_kda, mla_standins=a.step and not a.no_standins,
              head=a.step, attnres=a.step and a.attnres, mla=a.mla if a.step else 0, router_first=a.router_first,
              attn_heads=mc.define_value(defines, "ATTN_HEADS", a.cu), g_apart=a.g_apart and a.step and a.attnres,
              mla_g_apart=a.mla_g_apart and a.step and a.attnres and a.mla > 0)
    floor = res["bytes_floor_ms"]
    what = ("KDA + MoE" if res["kda"] else "MoE") + (" + MLA stand-ins" if res["mla_standins"] and not res.get(
        "mla") else "") + (f" + MLA over {res['mla']} cache rows" if res.get("mla") else "") + (
        " + LM head" if res["head"] else "") + (" + AttnRes" if res["attnres"] else "")
    print(f"{a.preset} {what} sublayers of layers {res['layers']}: {res['phases']} phases, "
          f"{res['bytes_read'] / 1e6:.0f} MB "
          f"(floor {floor:.3f} ms): " + ", ".join(f"{k} {v:.4f} ms" for k, v in res["ms"].items()), flush=True)
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.out)
        print(f"wrote {a.out}")
    if a.plot and "stream" in res["ms"]:
        plot(res, a.plot, TARGET_MS.get(a.preset) if res["head"] else None)
        print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
