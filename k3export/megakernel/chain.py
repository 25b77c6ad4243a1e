"""Milestone 1 of docs/megakernel.md: k3-small's B = 1 decode step as a synthetic chain of dependent phases, run as
ONE persistent launch (k3export/megakernel/chain.cu) that streams every phase's weights into shared memory ahead
of the phase's input. GPU only (sm_90a, nvcc and cupy on the GPU image); the chain, its reference and the table
are plain torch and tested on the CPU (tests/test_megakernel_chain.py).

The chain (`k3_small_chain`) has the step's ~180 dependent links and its bytes: per layer the projections at
their k3-small sizes (KDA in / out, MLA q / kv / absorbed / gate / out, MoE latent down / up, router, shared and
routed experts, the dense MLP of layer 0, the LM head), the links with few bytes between them (AttnRes + norm,
KDA conv and state, MLA norms and softmax) as 256 x 256 GEMVs, and the MoE's top-k, whose chosen experts' rows
the routed phases read. Each phase is y = W x (bf16 W, x rounded to bf16 as a bf16 model feeds a GEMV, fp32
sums and y) with x the output of its input phase, so the dependencies are real; the numbers are not a model's.

Modes (the same kernel): `stream` (weights streamed ahead, waiting only for free ring slots and, for routed
experts, for the top-k), `serial` (a tile's weights are fetched only once its inputs are done: the
launch-per-phase order, without launch costs) and `nodeps` (no waits at all: the bytes and the phase structure
alone; outputs wrong). Chains: `k3-small`; `skeleton`, the same links at narrow widths (as ab_decode.py's
SKELETON), whose `stream` time is the chain's latency without the bytes; `*-fused`, without the few-byte links
(a bound on fusing them); `bandwidth`, k3-small's bytes as one phase.

    python3 scripts/megakernel_chain.py [--chains k3-small,skeleton] [--modes stream,serial,nodeps]
                                        [--rings 3x65536[:DEFINE+...],...] [--rounds 3] [--iters 50]
                                        [--cu OTHER_CHAIN.cu] [--out F.json] [--plot F.png] [--tile-plot F.png]

Defines for a ring (chain.cu says what each does): MMA_TILES=0 (CUDA-core sums instead of the default tensor-core
tiles, which the host packs for them), MMA_MIN_K=n (tensor cores only for tiles at least n wide), WARP_ROWS=1 (each
warp sums whole rows, no barrier in a tile), TILE_IN_REGS=1 (with CONSUMER_WARPS=8+STEPS=8), TRACE (per x load: its
time and the wait for the tile after it, summarised per mode), TRACE_TILES (per tile: what the ring did, from the
producer, an observer warp and the consumers; `tile_pipeline`), and the diagnostics SKIP_COMPUTE, NOLOADX, NOCOPY
(no weights copied: the consumers alone) and NOHANDSHAKE (with NOCOPY: no producer either).

Checks each mode's outputs against a torch reference first (per phase, from the kernel's own inputs), then
times interleaved rounds (CUDA events around each launch) and records when each phase finished (%globaltimer).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import itertools
import json
import math
import os
import re
import statistics
import struct
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

CU = Path(__file__).resolve().parent / "chain.cu"
FIELDS = ("kind", "n", "k", "rows", "ntiles", "tile0", "src", "xlen", "xstride", "route", "ne", "w", "y",
          "n_experts", "dep2", "xlen2", "xop", "nxseg", "spare")   # chain.cu's `struct Phase`, one int64 each
KINDS = {"gemv": 0, "topk": 1, "routed": 2, "kda": 3, "attn": 4, "mix": 5, "mla": 6}   # (mix: no tiles, its words
#                                             written by a consumer's x load; mla: emulated only; attn: `Chain.attn`)
XOPS = {"glu": 1, "combine_norm": 2, "score": 3, "kda": 4, "headnorm": 5, "norm": 6,
        "sum": 7, "attnres": 8, "mla_q": 9, "mla_combine": 10, "gate": 11}     # chain.cu's `enum XOp`
SUM_MAX = 4                                          # ... "sum" adds at most this many phases' words
KDA_HEAD, KDA_CONV = 128, 4          # chain.cu's KDA phase: head dim (and f_a rank) and conv taps it is written for
KDA_FB_BYTES, KDA_COLS = 32768, 32   # chain.cu: a KDA tile is f_b's rows for a head, then 32 of its state's columns
KDA_TILE = KDA_FB_BYTES + KDA_HEAD * KDA_COLS * 4
KDA_TENSORS = {"state": torch.float32, "conv_state": torch.bfloat16, "conv_weight": torch.bfloat16,
               "a_log": torch.float32, "dt_bias": torch.float32, "f_b": torch.bfloat16}
KDA_AUX = ("conv_state", "conv_weight", "a_log", "dt_bias")      # chain.cu's `KdaAux`, in its order
PHASE_BYTES, XSEG_BYTES = 64, 64                     # chain.cu's PhaseC (in shared memory) and XSeg
PHASE_INT16 = ("kind", "rows", "src", "route", "n_experts", "dep2", "xop", "nxseg")   # PhaseC's 16-bit fields
MIX_AUX = "<qq2i3i3i2i4i2f2i"                        # chain.cu's `MixAux` (88 bytes)
MODES = {"stream": 0, "serial": 1, "nodeps": 2}


def cu_default(name: str, cu: Path = CU, default: int | None = None) -> int:
    """A #define's default in chain.cu (or another version of it; `default` where it has none)."""
    m = re.search(rf"#define {name} \(?(?:CONSUMERS \+ )?(\d+)", cu.read_text())
    if m is None:
        if default is not None:
            return default
        raise ValueError(f"no #define {name} in {cu}")
    return int(m.group(1))


def define_value(defines: tuple[str, ...], name: str, cu: Path = CU, default: int | None = None) -> int:
    """A #define's value in a build: given with -D`name`=V, else chain.cu's default."""
    given = [d.split("=", 1)[1] for d in defines if d.startswith(name + "=")]
    return int(given[-1]) if given else cu_default(name, cu, default)


XMAX = cu_default("XMAX")           # chain.cu: the longest x of a GEMV held in shared memory (bf16)
MIX_BANK, MIX_Y = cu_default("MIX_BANK"), cu_default("MIX_Y")   # ... an "attnres" x's bank rows and y's parts at most
MIX_MAX = cu_default("MIX_E") * 32 * cu_default("CONSUMER_WARPS")   # ... and its length (elements a thread x threads)
COMBINE_MAX = cu_default("COMBINE_MAX")   # ... top-k slots an X_COMBINE_NORM sums at most
XDUMP_SLOTS = cu_default("XDUMP_SLOTS")   # ... x slots per phase in xdump
XMAX_TOPK = XMAX // 2               # ... and of a top-k (fp32)
GROUPS = cu_default("GROUPS")       # ... row groups of a tile at most
TRACE_UNITS = cu_default("TRACE_UNITS")   # chain.cu -DTRACE: x loads traced per block
TRACE_FIELDS = cu_default("TRACE_FIELDS")  # ... times per x load
TILE_TRACE_MAX = cu_default("TILE_TRACE_MAX")   # chain.cu -DTRACE_TILES: tiles traced per block
TILE_FIELDS = cu_default("TILE_FIELDS")         # ... times per tile:
WANT, FREE, ISSUED, LANDED, TAKE, HAVE, DONE = range(7)   # producer wants the slot, has it, has issued the copy;
                                                          # the copy landed; consumers want it, have it, are done
MAX_ROWS = 64                       # rows per tile at most (few-byte phases still spread over several blocks)
CHECK_REL = 1e-5                    # fp32 sums of the same bf16 products in another order: ~3e-7 measured
# A KDA step against kda_step_k3, which has exact exp, divisions and square roots where the kernel has Triton's
# approximate ones (a few fp32 ulps each). The output (o rounded to bf16, before the head norm) within one bf16 step
# of its largest element: o is a sum with cancellation, so a small element can move by several of its own steps (H200
# 12-02 15:48, the whole-step chain: 12 in one element of 2048, 4 in another layer) while staying ~1e-7 of the
# state's scale. The state likewise within a bf16 step of its largest: q, k and v are rounded to bf16 after the conv's
# SiLU, so a few ulps of sigmoid can flip one of them by a step, and the state's update with it (with AttnRes's inputs,
# 12-02 18:58: 3.1e-4 in one layer of 9, ~1e-7 in the rest; the kernel against the Triton kernel, same call: 5.4e-8;
# tests/test_megakernel_layer.py holds that one to 1e-6). The conv window (copied) exact.
KDA_BOUNDS = {"o_max_rel": 2.0 ** -8, "state_max_rel": 2.0 ** -8, "conv_differ": 0}
# A mix (Block AttnRes, "attnres" x) against attnres_k3: p is one rounded add (exact). x: attnres_k3 sums in the
# kernel's order; with the scores' sums in torch's order it was 3 of 51200 elements, at most 4 bf16 steps (H200,
# 12-02 18:50: a mix with cancellation between its sources is small against the terms, so a score's last bits move
# it by steps). What is left are rsqrtf and expf, torch's on the GPU against chain.cu's.
MIX_BOUNDS = {"p_differ": 0, "x_max_ulps": 2}
ATTN_HEADS = cu_default("ATTN_HEADS")    # chain.cu: heads an ATTN tile (its x holds their queries)
ATTN_ROWS = cu_default("ATTN_ROWS_WARP") * cu_default("CONSUMER_WARPS")    # ... and its keys
ATTN_SPLITS = cu_default("ATTN_SPLITS")  # ... key blocks an X_MLA_COMBINE adds at most
WAITS = {1: "an input word of this launch", 2: "a filled ring slot", 3: "a free ring slot",
         4: "the top-k's words", 5: "an input phase's counter", 6: "the last step's token (STEP_LOOP)"}
NAN_SCORE = 7                            # err[0] when a top-k's key is NaN (err[3]: the expert), not a wait

# k3-small at B = 1, context 1024 (docs/megakernel.md's table); `lat` is the width of the few-byte links.
WIDTHS = dict(d=2048, q_rank=768, e_lat=1024, e_w=768, dense=8192, vocab=32768, kda_in=8376, heads=16,
              experts=64, topk=8, shared=2, ctx=1024, layers=12, mla=(3, 7, 11), lat=256)
# ab_decode.py's SKELETON widths (d 256, q latent 64, expert latent 128, expert / dense widths 64 / 256, vocab 1024)
SKELETON = dict(WIDTHS, d=256, q_rank=64, e_lat=128, e_w=64, dense=256, vocab=1024)


@dataclasses.dataclass
class Phase:
    name: str
    kind: str
    n: int                  # output rows (routed: top-k x rows per expert)
    k: int                  # input width (top-k: 0; it reads the n values of its src)
    src: int                # phase whose output is x (-1: the external input)
    xlen: int               # x[j] = y_src[slot * xstride + j % xlen] (+ y_dep2[j % xlen2])
    xstride: int = 0
    route: int = -1         # routed: the top-k phase
    ne: int = 0             # routed: rows per expert; top-k: k
    n_experts: int = 0
    dep2: int = -1          # a second input phase, added to x elementwise
    xlen2: int = 0
    rows: int = 1           # rows per tile
    ntiles: int = 1
    tile0: int = 0
    xop: int = -1           # x by recipe: Chain.xsegs[xop : xop + nxseg] (-1: x as above)
    nxseg: int = 0
    heads: int = 0          # attn: heads a tile (its head group; chain.cu's ATTN_HEADS; not a kernel field)
    spare: int = 0          # blocks its tiles skip (`Chain.gemv` beside; chain.cu `phase_stride`)

    @property
    def bytes_read(self) -> int:
        """Weight bytes this phase reads per launch (routed: only the chosen experts' rows; KDA: the fp32 state,
        which it also writes back; attn: the cache rows, once a head group)."""
        if self.kind == "attn":
            return (self.n - 1) * self.k * 2 * self.ne
        return 0 if self.kind == "topk" else self.n * self.k * 2

    @property
    def live_blocks(self) -> int:
        """attn: the key blocks that hold keys this launch (chain.cu built with LIVE_SPLITS writes and combines only
        these: the first live_blocks ne tiles)."""
        return -(-self.n // self.rows)

    @property
    def words(self) -> int:
        """Output words (attn: per tile and head of its group, [m, l, O]; `Chain.attn`)."""
        return self.ntiles * self.heads * (self.xlen + 2) if self.kind == "attn" else self.n

    @property
    def weight_elems(self) -> int:
        """Weight elements stored in the chain's weight buffer (routed: every expert; KDA: none, its state is its
        own buffer)."""
        return {"gemv": self.n * self.k, "topk": 0, "kda": 0, "mix": 0, "mla": 0, "attn": 0,
                "routed": self.n_experts * self.ne * self.k}[self.kind]


@dataclasses.dataclass
class XSeg:
    """One part of a phase's x by recipe (chain.cu's `XSeg`, which says what each op computes): x[j0 + j], j < len,
    from the words of phase src's output at off + slot * stride + j.
    - "glu": bf16(SiTU-GLU(a, b)), b off2 words after a; round_in: a and b rounded to bf16 first;
    - "combine_norm": the MoE combine over nslot slots (stride words apart) with top-k phase route's weights, then
      RMSNorm with weight aux (bf16 [len]) and eps;
    - "score" (a top-k's x): sigmoid, correction bias aux (fp32 [len]) for the choice, weights renormalised when
      renorm, times scaling;
    - "kda" (a KDA phase's, `Chain.kda`): q | k | v at off of src's words, b at stride, f_a at route (a word
      offset here), nslot heads, decay bound lb; `tensors` the step's own (`KDA_TENSORS`);
    - "sum": bf16 of the words at off of phases src .. src + nslot - 1 (nslot <= SUM_MAX), added in order;
    - "norm": RMSNorm (eps, weight aux bf16 [len]) of bf16(src's words at off + route's at off2 when route >= 0);
    - "headnorm" (after a KDA phase src): per head of 128, RMSNorm (eps, weight aux bf16 [128]) times sigmoid(g),
      g the words of phase route at off2 (`kda_headnorm_k3`);
    - "attnres" (a GEMV's only part; made by `Chain.gemv_after`): Block AttnRes of the "mix" phase src
      (`attnres_k3`), computed by every consuming block; the mix's consumers share the part, and the first one's
      block with tile 0 writes the mix's words [x | p] (`Chain.mix_writers`)."""
    op: str
    src: int
    len: int
    off: int = 0
    off2: int = 0
    stride: int = 0
    route: int = -1
    nslot: int = 0
    round_in: bool = False
    renorm: bool = False
    aux: torch.Tensor | None = None
    beta: float = 0.0
    lb: float = 0.0
    eps: float = 0.0
    scaling: float = 1.0
    tensors: dict | None = None

    def packed(self, aux_ptr: int) -> bytes:
        return struct.pack("<q10i4f", aux_ptr, XOPS[self.op], self.src, self.off, self.len, self.off2, self.stride,
                           self.route, self.nslot, int(self.round_in), int(self.renorm), self.beta, self.lb, self.eps,
                           self.scaling)


@dataclasses.dataclass
class Mix:
    """A Block AttnRes phase (`Chain.mix`): its sources are references to vectors, each "input" (the chain's external
    x), None (zero) or (phase, word offset)."""
    bank: list
    p_prev: object
    y: list[int]                    # the sublayer output's phases, added (none: p = p_prev)
    res_norm: torch.Tensor | None
    res_query: torch.Tensor | None
    out_norm: torch.Tensor
    eps: float
    out_eps: float


class Chain:
    """Phases in launch order; each phase's inputs come before it, and its tiles follow the previous phase's.
    `init`: weights given for a phase (its index -> a tensor of `Buffers.weights`' shape); the rest are random.
    `xsegs`: the x recipes the phases point at."""

    def __init__(self, x_len: int, slot_bytes: int = 65536, min_tiles: int = 0, max_rows: int = MAX_ROWS):
        """min_tiles: a phase's tiles are made smaller (down to 16 rows, the tensor-core tile) while it has fewer than
        this many (e.g. the number of blocks: a phase on the critical path then spreads over more SMs); max_rows:
        rows per tile at most."""
        self.x_len, self.slot_bytes, self.phases = x_len, slot_bytes, []
        self.min_tiles, self.max_rows = min_tiles, max_rows
        self.init: dict[int, torch.Tensor] = {}
        self.xsegs: list[XSeg] = []
        self.mixes: dict[int, Mix] = {}
        self.mlas: dict[int, dict] = {}
        self.caches: dict[int, dict] = {}       # attn phase -> its cache ("cache") and "capacity" (`attn`)

    def _recipe(self, ph: Phase, segs: list[XSeg] | None, weight: torch.Tensor | None) -> Phase:
        """Attach x recipe parts and given weights to the phase about to be added (checked here)."""
        p = len(self.phases)
        if weight is not None:
            shape = (ph.n_experts, ph.ne, ph.k) if ph.kind == "routed" else (ph.n, ph.k)
            if tuple(weight.shape) != shape:
                raise ValueError(f"{ph.name}: weight {tuple(weight.shape)}, the phase needs {shape}")
            self.init[p] = weight.detach()
        if not segs:
            return ph
        if ph.kind == "kda":                # (checked by `kda`)
            ph.xop, ph.nxseg = len(self.xsegs), 1
            self.xsegs += segs
            return ph
        width = ph.xlen if ph.kind == "topk" else (ph.heads + 1) * ph.k if ph.kind == "attn" else ph.k
        if sum(g.len for g in segs) != width:
            raise ValueError(f"{ph.name}: x recipe parts cover {sum(g.len for g in segs)} of x's {width}")
        for g in segs:
            if g.op not in XOPS:
                raise ValueError(f"{ph.name}: unknown x recipe op {g.op!r} (choose from {', '.join(XOPS)})")
            if g.op == "kda":
                raise ValueError(f"{ph.name}: a 'kda' x is a KDA phase's (Chain.kda)")
            if g.op == "attnres":
                if ph.kind != "gemv" or len(segs) != 1 or not (0 <= g.src < p and g.src in self.mixes):
                    raise ValueError(f"{ph.name}: an 'attnres' x is a GEMV's only part, of an earlier mix phase")
                if g.len != self.phases[g.src].n // 2 or g.len > MIX_MAX:
                    raise ValueError(f"{ph.name}: 'attnres' over {g.len} elements: the mix's {self.phases[g.src].n // 2}, "
                                     f"at most {MIX_MAX}")
                ph.xop, ph.nxseg = len(self.xsegs), 1
                self.xsegs += segs
                return ph
            if (g.op == "mla_q") != (ph.kind == "attn" and g is segs[0]):
                raise ValueError(f"{ph.name}: an 'mla_q' part is an attn phase's first (Chain.attn)")
            if g.op == "mla_q":             # (checked by `attn`)
                continue
            if (g.op == "score") != (ph.kind == "topk"):
                raise ValueError(f"{ph.name}: a top-k's x recipe is one 'score' part, and 'score' is only a top-k's")
            if not 0 <= g.src < p:
                raise ValueError(f"{ph.name}: x recipe reads phase {g.src}, which is not before it")
            if g.op == "combine_norm":
                if not (0 <= g.route < p and self.phases[g.route].kind == "topk"):
                    raise ValueError(f"{ph.name}: combine weights from phase {g.route}, not an earlier top-k")
                if not 0 < g.nslot <= min(COMBINE_MAX, self.phases[g.route].ne):
                    raise ValueError(f"{ph.name}: combine over {g.nslot} slots (at most {COMBINE_MAX} and the "
                                     f"top-k's {self.phases[g.route].ne})")
            if g.op == "sum" and not (1 <= g.nslot <= SUM_MAX and g.src + g.nslot <= p and all(
                    g.off + g.len <= self.phases[q].n for q in range(g.src, g.src + g.nslot))):
                raise ValueError(f"{ph.name}: 'sum' adds words {g.off}..{g.off + g.len} of {g.nslot} phases from "
                                 f"{g.src} (1..{SUM_MAX} earlier phases with that many words)")
            if g.op == "norm" and g.route >= 0 and not (g.route < p and g.off2 + g.len <= self.phases[g.route].n):
                raise ValueError(f"{ph.name}: 'norm' adds words {g.off2}.. of phase {g.route}, which is not an "
                                 f"earlier phase with that many")
            if g.op in ("combine_norm", "score", "norm") and (g.aux is None or g.aux.numel() != g.len):
                raise ValueError(f"{ph.name}: {g.op} needs its {g.len} weights (aux)")
            if g.op == "headnorm":
                if self.phases[g.src].kind != "kda" or g.len % KDA_HEAD:
                    raise ValueError(f"{ph.name}: 'headnorm' reads a KDA phase's heads (src {g.src}: "
                                     f"{self.phases[g.src].name})")
                if g.aux is None or g.aux.numel() != KDA_HEAD:
                    raise ValueError(f"{ph.name}: 'headnorm' needs the head norm's {KDA_HEAD} weights (aux)")
                if sum(x.len for x in segs) > XMAX // 2:
                    raise ValueError(f"{ph.name}: a 'headnorm' x is at most {XMAX // 2} long (chain.cu keeps its "
                                     f"sums of squares in x's second half)")
                if not (0 <= g.route < p and g.off2 + g.len <= self.phases[g.route].n):
                    raise ValueError(f"{ph.name}: 'headnorm' reads g at words {g.off2}.. of phase {g.route}, which "
                                     f"is not an earlier phase with that many")
            # the last word it reads must be src's: over the combine's slots, or a per-slot x's (routed) slots
            slots = g.nslot if g.op in ("combine_norm", "mla_combine") else self.slots(ph)
            end = g.off + (slots - 1) * g.stride + (g.off2 if g.op == "glu" else 0) + g.len
            if g.op == "mla_combine":       # (and the head's partials: [m, l, O] a head)
                end += (self.slots(ph) - 1) * (g.len + 2) + 2
            if g.op == "gate" and not (0 <= g.route < p and g.off2 + g.len <= self.phases[g.route].n):
                raise ValueError(f"{ph.name}: 'gate' reads g at words {g.off2}.. of phase {g.route}, which is not an "
                                 f"earlier phase with that many")
            if g.op == "mla_combine" and (self.phases[g.src].kind != "attn" or not 0 < g.nslot <= ATTN_SPLITS):
                raise ValueError(f"{ph.name}: 'mla_combine' adds 1..{ATTN_SPLITS} key blocks of an attn phase")
            if end > self.phases[g.src].words:
                raise ValueError(f"{ph.name}: x recipe reads words up to {end} of phase {g.src} "
                                 f"({self.phases[g.src].name}), which has {self.phases[g.src].words}")
        ph.xop, ph.nxseg = len(self.xsegs), len(segs)
        self.xsegs += segs
        return ph

    def _rows(self, n: int, k: int, ne: int = 0) -> int:
        """Rows per tile: a power of two that fills a slot (at most MAX_ROWS), no more than n needs; routed tiles
        stay within one expert. A GEMV's last tile may be part of one."""
        r = min(self.max_rows, 1 << int(math.log2(self.slot_bytes // (2 * k))))
        while r > 1 and r // 2 >= n:
            r //= 2
        while r > 16 and -(-n // r) < self.min_tiles:
            r //= 2
        while ne and ne % r:
            r //= 2
        return r

    def _add(self, ph: Phase) -> int:
        """(Its input phases were checked by `_xlen` while the phase was built.)"""
        p = len(self.phases)
        if ph.kind not in ("topk", "mix", "mla") and (ph.k % 8 or not 0 < ph.k <= XMAX or 2 * ph.k > self.slot_bytes):
            raise ValueError(f"{ph.name}: k = {ph.k} must be a multiple of 8, at most {XMAX} and fit a slot")
        prev = self.phases[-1] if self.phases else None
        ph.tile0 = prev.tile0 + prev.ntiles if prev else 0
        self.phases.append(ph)
        return p

    def _xlen(self, src: int, name: str) -> int:
        if not -1 <= src < len(self.phases):
            raise ValueError(f"{name}: depends on phase {src}, which is not before it (phase {len(self.phases)})")
        return self.x_len if src < 0 else self.phases[src].n

    def slots(self, ph: Phase) -> int:
        """The x slots of a phase: a routed phase with per-slot x, its top-k's k (a fixed route: every expert); an
        attn phase, its head groups; else 1."""
        if ph.kind == "attn":
            return ph.ne
        if ph.kind == "routed" and ph.xstride:
            return ph.n_experts if ph.route < 0 else self.phases[ph.route].ne
        return 1

    def gemv(self, name: str, n: int, k: int, src: int, dep2: int = -1, xsegs: list[XSeg] | None = None,
             weight: torch.Tensor | None = None, beside: int = -1) -> int:
        """y = W x; x from src (+ dep2), or by the recipe `xsegs` (then src only names the first input).

        beside: the phase just before this one, whose tiles its blocks run meanwhile (a phase this one does not
        read): this phase's tiles are then dealt over the other blocks only, the nblk - ntiles(beside) after
        beside's, while they are at least a quarter of the grid (`block_tiles`; chain.cu `phase_stride`; beside's
        tiles counted up to 255); so none of them waits behind a tile of beside. The outputs are the same wherever
        a tile runs."""
        rows = self._rows(n, k)
        xlen2 = self._xlen(dep2, name) if dep2 >= 0 else 0
        spare = 0
        if beside >= 0:
            if beside != len(self.phases) - 1 or self.phases[beside].ntiles < 1:
                raise ValueError(f"{name}: beside = {beside}: must be the phase just before it "
                                 f"({len(self.phases) - 1}), with tiles")
            spare = min(self.phases[beside].ntiles, 255)
        return self._add(self._recipe(Phase(name, "gemv", n, k, src, self._xlen(src, name), dep2=dep2, xlen2=xlen2,
                                            rows=rows, ntiles=-(-n // rows), spare=spare), xsegs, weight))

    def topk(self, name: str, k: int, src: int, score: XSeg | None = None) -> int:
        """The ids of src's k largest values; with `score` (a "score" recipe) of the router's scores, and the
        weights after the ids (2k outputs)."""
        n = score.len if score else self._xlen(src, name)          # (a score recipe: its part of src's words)
        if not 0 < k <= n or (2 * n + k if score else n) > XMAX_TOPK:
            raise ValueError(f"{name}: top-{k} of {n} values")
        return self._add(self._recipe(Phase(name, "topk", 2 * k if score else k, 0, src, n, ne=k),
                                      [score] if score else None, None))

    def routed(self, name: str, route: int, ne: int, k: int, n_experts: int, src: int, per_slot: bool = False,
               xsegs: list[XSeg] | None = None, weight: torch.Tensor | None = None) -> int:
        """The chosen experts' rows: `ne` rows of [n_experts, ne, k] per top-k slot; with per_slot, slot s reads its
        own part of src's output (src routed too, `k` of its rows per expert; with a recipe, `xsegs`' stride)."""
        self._xlen(route, name)
        tk = self.phases[route]
        if tk.kind != "topk":
            raise ValueError(f"{name}: phase {route} ({tk.name}) is not a top-k")
        n = tk.ne * ne
        rows = self._rows(n, k, ne)
        xstride, xlen = (self.phases[src].ne, k) if per_slot else (0, self._xlen(src, name))
        if xsegs and per_slot and any(g.stride != xstride for g in xsegs):
            raise ValueError(f"{name}: per-slot recipe parts must step {xstride} words a slot")
        return self._add(self._recipe(Phase(name, "routed", n, k, src, xlen, xstride, route, ne, n_experts,
                                            rows=rows, ntiles=n // rows), xsegs, weight))

    def heads(self, name: str, heads: int, ne: int, k: int, src: int, xstride: int,
              xsegs: list[XSeg] | None = None, weight: torch.Tensor | None = None) -> int:
        """A routed phase with a fixed route, slot h = expert h for h < heads (MLA's per-head BMM1 and BMM2): `ne`
        rows of [heads, ne, k] a head, slot h's x the k words at h xstride of src (or by the per-slot recipe)."""
        self._xlen(src, name)
        rows = self._rows(heads * ne, k, ne)
        return self._add(self._recipe(Phase(name, "routed", heads * ne, k, src, k, xstride, -1, ne, heads,
                                            rows=rows, ntiles=heads * ne // rows), xsegs, weight))

    def attn(self, name: str, ql: int, qb: int, proj: int, kv_off: int, heads: int, rank: int, nope: int, pe: int,
             cache: torch.Tensor, cache_len: int, scale: float, kv_norm: torch.Tensor, eps: float,
             capacity: int = 0, heads_tile: int = ATTN_HEADS) -> int:
        """MLA decode attention at B = 1 over the latent cache (chain.cu's ATTN): keys the cache's rows
        [:cache_len] (`cache` [rows > cache_len, rank + pe], the layer's, which the launch appends the new row to)
        and the new row, [RMSNorm(kv_norm, eps) of proj's words kv_off .. + rank | its pe words after them]; each
        head's query [ql_h (BMM1's words, rank a head) | q_pe_h (q_b's words, nope + pe a head, at nope)]. Tiles:
        key blocks of `rows` keys x head groups of heads_tile (the kernel's ATTN_HEADS, default its default: a
        build with -DATTN_HEADS=heads_tile runs it); the words per tile and head [m, l, O] (X_MLA_COMBINE
        adds them, in BMM2's x). capacity: the most keys a launch may have (its tiles; default cache_len + 1):
        `Buffers.set_cache_len` moves cache_len up to capacity - 1 between launches, the tiles past the keys empty."""
        R = rank + pe
        capacity = capacity or cache_len + 1
        if heads % heads_tile:
            raise ValueError(f"{name}: {heads} heads; chain.cu's attention takes them {heads_tile} a tile")
        if tuple(cache.shape[1:]) != (R,) or not 0 <= cache_len < capacity <= cache.shape[0]:
            raise ValueError(f"{name}: cache {tuple(cache.shape)}, rows of {R} and room for rows up to {capacity - 1}; "
                             f"cache_len {cache_len}")
        rows, nblk = ATTN_ROWS, -(-capacity // ATTN_ROWS)
        if nblk > ATTN_SPLITS or rows * R * 2 > self.slot_bytes or \
                attn_scratch_bytes(heads_tile, R, rows) > XMAX * 2:
            raise ValueError(f"{name}: {capacity} keys of {R} do not split into {ATTN_SPLITS} blocks of {rows} "
                             f"that fit a slot and x's scratch (chain.cu's ATTN_SPLITS, ATTN_ROWS_WARP)")
        segs = [XSeg("mla_q", ql, heads_tile * R, stride=rank, off2=nope, route=qb, nslot=heads_tile,
                     scaling=scale),
                XSeg("norm", proj, rank, off=kv_off, aux=kv_norm, eps=eps),
                XSeg("sum", proj, pe, off=kv_off + rank, nslot=1)]
        if not (0 <= ql < qb < proj or 0 <= proj < qb < ql) or self.phases[ql].n != heads * rank or \
                self.phases[qb].n != heads * (nope + pe) or kv_off + R > self.phases[proj].n:
            raise ValueError(f"{name}: BMM1 ({ql}), q_b ({qb}) and the projection ({proj}) do not have the shapes "
                             f"of {heads} heads of rank {rank}, nope {nope}, pe {pe}")
        p = self._add(self._recipe(Phase(name, "attn", cache_len + 1, R, ql, rank, ne=heads // heads_tile,
                                         rows=rows, ntiles=nblk * heads // heads_tile, heads=heads_tile), segs,
                                   None))
        self.caches[p] = {"cache": cache.detach(), "capacity": capacity}
        return p

    def cache_len(self, p: int) -> int:
        """Attn phase p's cache rows before this launch's (its keys but the new row: the phase's n - 1)."""
        return self.phases[p].n - 1

    def kda(self, name: str, src: int, heads: int, q_off: int, b_off: int, fa_off: int, lb: float,
            **tensors: torch.Tensor) -> int:
        """The KDA decode step at B = 1 (chain.cu `load_x_kda`, `kda_tile`), without its head norm and gate (the
        next phase's "headnorm" x). Tile 4 h + q: head h's value columns 32 q .. 32 q + 31, the tile f_b's rows for
        the head and those columns of its fp32 state (`Buffers` keeps them so), streamed through the ring and the
        state part written back in place. Reads the input projection src's words (q | k | v at q_off, b at b_off,
        f_a at fa_off, each rounded to bf16 as a bf16 GEMV's output) and sums f = f_b f_a in the step, as the Triton
        kernel does. `tensors`: state [H, 128, 128] fp32, conv_state [3 H 128, 3], conv_weight [3 H 128, 4],
        a_log [>= H], dt_bias [H 128], f_b [H 128, 128] (`KDA_TENSORS`). The output: the heads' o, rounded to bf16,
        H 128 words."""
        self._xlen(src, name)
        H, K, C = heads, KDA_HEAD, 3 * heads * KDA_HEAD
        if set(tensors) != set(KDA_TENSORS):
            raise ValueError(f"{name}: needs the tensors {', '.join(KDA_TENSORS)}; got {', '.join(tensors)}")
        shapes = {"state": (H, K, K), "conv_state": (C, KDA_CONV - 1), "conv_weight": (C, KDA_CONV),
                  "dt_bias": (H * K,), "f_b": (H * K, K)}
        for key, shape in shapes.items():
            if tuple(tensors[key].shape) != shape:
                raise ValueError(f"{name}: {key} {tuple(tensors[key].shape)}, the step needs {shape} (head dim and "
                                 f"f_a rank {K}, a {KDA_CONV}-tap conv: what chain.cu's KDA phase is written for)")
        if tensors["a_log"].dim() != 1 or tensors["a_log"].numel() < H:
            raise ValueError(f"{name}: a_log {tuple(tensors['a_log'].shape)}, needs [>= {H}]")
        n_src = self.phases[src].n
        for what, start, end in (("q | k | v", q_off, q_off + C), ("b", b_off, b_off + H), ("f_a", fa_off, fa_off + K)):
            if start < 0 or end > n_src:
                raise ValueError(f"{name}: {what} ends at word {end} of phase {src} ({self.phases[src].name}), "
                                 f"which has {n_src}")
        if KDA_TILE > self.slot_bytes:
            raise ValueError(f"{name}: a KDA tile is {KDA_TILE} bytes, over a slot's {self.slot_bytes}")
        seg = XSeg("kda", src, H * K, off=q_off, stride=b_off, route=fa_off, nslot=H, lb=lb,
                   tensors={k: v.detach() for k, v in tensors.items()})
        # tiles of 32 "rows" (the columns it writes) of KDA_TILE / 64 bf16 words
        return self._add(self._recipe(Phase(name, "kda", H * K, KDA_TILE // (2 * KDA_COLS), src, n_src,
                                            rows=KDA_COLS, ntiles=H * K // KDA_COLS), [seg], None))

    def mix(self, name: str, d: int, bank: list, p_prev, y: list[int], res_norm, res_query, out_norm, eps: float,
            out_eps: float) -> int:
        """Block AttnRes before a sublayer (`K3Model._layers`, `k3::attn_res_add_norm`): p = bf16(p_prev + y), the
        softmax over depth of the sources (the sealed bank rows, then p; scores rsqrt(mean(v^2) + eps) (v .
        res_norm res_query)), their mix rounded, then the RMSNorm (out_norm, out_eps). Its words are [x | p]
        (2 d): x for the sublayer's GEMVs, p for later mixes and seals (word offset d). The phase has no tiles: its
        consumers (`gemv_after`) each compute it in their x load, and the first one writes its words."""
        for ref in [*bank, p_prev]:
            if ref not in (None, "input") and not (isinstance(ref, tuple) and ref[0] in self.mixes and ref[1] == d):
                raise ValueError(f"{name}: source {ref!r} is not 'input', None or an earlier mix's p (mix, {d})")
        if d % 2:
            raise ValueError(f"{name}: d = {d}; chain.cu keeps p two elements a word")
        if any(not 0 <= q < len(self.phases) for q in y):
            raise ValueError(f"{name}: y's phases {y} are not all earlier phases")
        if len(bank) > MIX_BANK or len(y) > MIX_Y:
            raise ValueError(f"{name}: {len(bank)} bank rows and {len(y)} parts of y; chain.cu's AttnRes takes at most "
                             f"{MIX_BANK} and {MIX_Y}")
        p = self._add(Phase(name, "mix", 2 * d, 0, -1, 0, ntiles=0))
        self.mixes[p] = Mix(list(bank), p_prev, list(y), res_norm, res_query, out_norm, eps, out_eps)
        return p

    def gemv_after(self, name: str, n: int, mix: int, weight: torch.Tensor | None = None) -> int:
        """y = W x, x the AttnRes of "mix" phase `mix` computed in this phase's x load (the "attnres" recipe); the
        mix's first such phase writes its words."""
        if mix not in self.mixes:
            raise ValueError(f"{name}: phase {mix} is not a mix")
        d = self.phases[mix].n // 2
        shared = [i for i, g in enumerate(self.xsegs) if g.op == "attnres" and g.src == mix]
        if not shared:
            return self.gemv(name, n, d, mix, xsegs=[XSeg("attnres", mix, d)], weight=weight)
        p = self.gemv(name, n, d, mix, weight=weight)
        self.phases[p].xop, self.phases[p].nxseg = shared[0], 1          # (the first consumer's part)
        return p

    def mix_writers(self) -> dict[int, int]:
        """Each mix phase -> the phase whose x load writes its words: its first consumer (absent: none)."""
        out = {}
        for p, ph in enumerate(self.phases):
            for g in self.xsegs[ph.xop:ph.xop + ph.nxseg] if ph.xop >= 0 else ():
                if g.op == "attnres":
                    out.setdefault(g.src, p)
        return out

    def mla(self, name: str, src: int, attn, cache: torch.Tensor, cache_len: int) -> int:
        """A Gated MLA attention sublayer at B = 1 over cache rows [:cache_len] (`cache` [rows, R], the layer's
        latent cache), its x the first d words of phase src. Its words are [y | the new latent row]. Emulated only,
        by the model's own `GatedMLA.decode` (a placeholder for the kernel's arithmetic, which is not designed yet:
        docs/megakernel.md, "Next"); `ChainKernel.bind` refuses a chain with one."""
        d = attn.o_proj.out_features
        self._xlen(src, name)
        if self.phases[src].n < d or not 0 <= cache_len <= cache.shape[0]:
            raise ValueError(f"{name}: x from phase {src} needs {d} words; cache_len {cache_len} of "
                             f"{cache.shape[0]} rows")
        p = self._add(Phase(name, "mla", d + cache.shape[1], 0, src, self.phases[src].n, ntiles=0))
        self.mlas[p] = {"attn": attn, "cache": cache.detach(), "cache_len": cache_len}
        return p

    @property
    def ntiles(self) -> int:
        return sum(p.ntiles for p in self.phases)

    @property
    def bytes_read(self) -> int:
        return sum(p.bytes_read for p in self.phases)


def k3_small_chain(w: dict = WIDTHS, slot_bytes: int = 65536, fuse: bool = False) -> Chain:
    """fuse: without the few-byte links (AttnRes + norm, KDA conv, MLA norms and softmax, final norm), as if each
    were computed inside the next phase's input load; that extra work is not modelled (a bound on what fusing
    them can give)."""
    c = Chain(w["d"], slot_bytes)
    d, lat, heads = w["d"], w["lat"], w["heads"]

    def mix(name: str, src: int) -> int:
        return src if fuse else c.gemv(name, lat, lat, src)

    h = -1
    for layer in range(w["layers"]):
        L = f"L{layer}."
        a = mix(L + "attn_res+norm", h)
        if layer in w["mla"]:
            qa = c.gemv(L + "mla.q_kv_a", w["q_rank"] + 576, d, a)
            nq = mix(L + "mla.norms", qa)
            qb = c.gemv(L + "mla.q_b", heads * 192, w["q_rank"], nq)
            ak = c.gemv(L + "mla.absorb_k", heads * 512, 128, qb)
            sc = c.gemv(L + "mla.scores", w["ctx"], 576, ak)
            sm = mix(L + "mla.softmax", sc)
            av = c.gemv(L + "mla.absorb_v", heads * 128, 512, sm)
            gt = c.gemv(L + "mla.gate", heads * 128, d, a)
            att = c.gemv(L + "mla.o", d, heads * 128, av, dep2=gt)
        else:
            i = c.gemv(L + "kda.in", w["kda_in"], d, a)
            cv = mix(L + "kda.conv+gates", i)
            st = c.gemv(L + "kda.state", heads * 128, lat, cv)
            att = c.gemv(L + "kda.out", d, heads * 128, st)
        m = mix(L + "attn_res+norm.mlp", att)
        if layer == 0:
            gu = c.gemv(L + "dense.gate_up", 2 * w["dense"], d, m)
            h = c.gemv(L + "dense.down", d, w["dense"], gu)
            continue
        dn = c.gemv(L + "moe.down", w["e_lat"], d, m)
        r = c.gemv(L + "moe.router", w["experts"], w["e_lat"], dn)
        sgu = c.gemv(L + "moe.shared_gate_up", 2 * w["shared"] * w["e_w"], d, m)
        tk = c.topk(L + "moe.topk", w["topk"], r)
        # the shared down before the routed experts: its weights stream while the producers wait for the top-k
        sd = c.gemv(L + "moe.shared_down", d, w["shared"] * w["e_w"], sgu)
        rgu = c.routed(L + "moe.routed_gate_up", tk, 2 * w["e_w"], w["e_lat"], w["experts"], dn)
        rd = c.routed(L + "moe.routed_down", tk, w["e_lat"], w["e_w"], w["experts"], rgu, per_slot=True)
        h = c.gemv(L + "moe.up", d, w["e_lat"], rd, dep2=sd)
    c.gemv("lm_head", w["vocab"], d, mix("final_norm", h))
    return c


def bandwidth_chain(slot_bytes: int = 65536) -> Chain:
    """k3-small's bytes (1448 MB) in one GEMV without links: what the kernel streams with no phase to wait for."""
    c = Chain(2048, slot_bytes)
    c.gemv("all_bytes", 353536, 2048, -1)
    return c


CHAINS = {"k3-small": lambda sb: k3_small_chain(WIDTHS, sb), "skeleton": lambda sb: k3_small_chain(SKELETON, sb),
          "k3-small-fused": lambda sb: k3_small_chain(WIDTHS, sb, fuse=True),
          "skeleton-fused": lambda sb: k3_small_chain(SKELETON, sb, fuse=True), "bandwidth": bandwidth_chain}


def bf16r(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def sigmoid_k3(x: torch.Tensor) -> torch.Tensor:
    """chain.cu `sigmoid_k3` (plugins/moe/kernels.py `_sigmoid`), op for op in fp32."""
    return 1.0 / (1.0 + torch.exp(-x))


def tanh_k3(x: torch.Tensor) -> torch.Tensor:
    """chain.cu `tanh_k3` (plugins/moe/kernels.py `_tanh`), op for op in fp32."""
    ax = x.abs()
    t = torch.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    x2 = ax * ax
    small = ax * (1.0 - x2 * ((1.0 / 3.0) - x2 * ((2.0 / 15.0) - x2 * (17.0 / 315.0))))
    r = torch.where(ax < 0.1, small, big)
    return torch.where(x < 0, -r, r)


def situ_glu_k3(a: torch.Tensor, b: torch.Tensor, beta: float, lb: float) -> torch.Tensor:
    """chain.cu `situ_glu_k3`. (Divided by tensors: torch divides by a Python number as a multiply by its
    reciprocal, which rounds differently from a / 25.)"""
    return beta * tanh_k3(a / torch.full_like(a, beta)) * sigmoid_k3(a) * (lb * tanh_k3(b / torch.full_like(b, lb)))


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fmaf(a, b, c) for fp32 tensors (the product is exact in fp64; one rounding to fp64, then to fp32)."""
    return (a.double() * b.double() + c.double()).float()


def kda_sumsq(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares over the last dim (128) as chain.cu's `warp_squares` / `four_warps` (and Triton 3.6's tl.sum
    in the KDA kernel) order it: per warp of 32 a butterfly (lane 0's view), then (W0 + W2) + (W1 + W3)."""
    s = (x * x).unflatten(-1, (4, 32))
    lane = torch.arange(32, device=x.device)
    for o in (16, 8, 4, 2, 1):
        s = s + s[..., lane ^ o]
    w = s[..., 0]
    return (w[..., 0] + w[..., 2]) + (w[..., 1] + w[..., 3])


def kda_chain_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum over k (128) of x[..., k, :] y[..., k, None] as chain.cu's `kda_tile` makes it: 16 partials of 8 k in
    order (the first product rounded, then FMAs), added in order."""
    total = None
    for k0 in range(0, 128, 8):
        acc = x[..., k0, :] * y[..., k0, None]
        for k in range(k0 + 1, k0 + 8):
            acc = fma32(x[..., k, :], y[..., k, None].expand_as(acc), acc)
        total = acc if total is None else total + acc
    return total


def kda_fold_k3(f_a: torch.Tensor, f_b: torch.Tensor) -> torch.Tensor:
    """f = f_b f_a as chain.cu's `kda_tile` sums it: per row, four quarters of 32 columns each in order (from 0, by
    FMAs), then (Q0 + Q1) + (Q2 + Q3), rounded to bf16. f_a [128], f_b [H 128, 128]."""
    w = f_b.float().view(-1, 4, 32)
    a = f_a.float().view(4, 32).expand_as(w)
    q = w[..., 0] * a[..., 0]
    for r in range(1, 32):
        q = fma32(w[..., r], a[..., r], q)
    return bf16r((q[:, 0] + q[:, 1]) + (q[:, 2] + q[:, 3]))


def kda_step_k3(qkv, conv_state, conv_weight, f_a, f_b, b, a_log, dt_bias, state, lb: float):
    """chain.cu's KDA step (`load_x_kda`, `kda_tile`) in torch, op for op in fp32, except that exp, the divisions
    and the square roots here are exact where the kernel (as Triton 3.6) uses ex2.approx, div.full and the
    approximate sqrt. qkv [3 H 128], f_a [128], b [H]: the input projection's outputs as bf16 values; f_b
    [H 128, 128]; conv_state [3 H 128, 3], conv_weight [3 H 128, 4]; state [H, 128, 128] (k, v). Returns (o
    [H 128] rounded to bf16, before the head norm and gate: `kda_headnorm_k3`; the new state; the new window)."""
    H, K = b.numel(), KDA_HEAD
    u = torch.cat([conv_state.float(), qkv[:, None]], 1)
    prod = u * conv_weight.float()
    y = (prod[:, 0] + prod[:, 2]) + (prod[:, 1] + prod[:, 3])
    q, k, v = bf16r(y * sigmoid_k3(y)).view(3, H, K)
    one = torch.ones((), device=q.device)
    qn = q / torch.sqrt(kda_sumsq(q) + 1e-6)[:, None] * torch.tensor(K ** -0.5, dtype=torch.float32)
    kn = k / torch.sqrt(kda_sumsq(k) + 1e-6)[:, None]
    A = torch.exp(a_log[:H].float())
    f = kda_fold_k3(f_a, f_b)
    s = one / (one + torch.exp(-(A[:, None] * (f.view(H, K) + dt_bias.view(H, K).float()))))
    alpha = torch.exp(s * lb)
    beta = sigmoid_k3(b)
    s1 = state * alpha[:, :, None]
    err = v - kda_chain_sum(s1, kn)
    s2 = fma32((kn * beta[:, None])[:, :, None].expand_as(s1), err[:, None, :].expand_as(s1), s1)
    return bf16r(kda_chain_sum(s2, qn)).reshape(-1), s2, u[:, 1:].to(conv_state.dtype)


def kda_headnorm_k3(o: torch.Tensor, g: torch.Tensor, o_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """chain.cu's X_HEADNORM (the KDA kernel's head RMSNorm and output gate) in torch, exact rsqrt and division:
    per head of 128, bf16(bf16(w bf16(o rsqrt(mean(o^2) + eps))) sigmoid(g)). o, g: bf16 values [H 128]."""
    ob = o.view(-1, KDA_HEAD)
    r = torch.rsqrt(kda_sumsq(ob) / torch.tensor(float(KDA_HEAD)) + eps)
    wn = bf16r(o_norm.float() * bf16r(r[:, None] * ob))
    return bf16r(wn * sigmoid_k3(g.view(-1, KDA_HEAD))).reshape(-1)


def block_dot_k3(a: torch.Tensor, b: torch.Tensor, threads: int = 512, pairs: bool = False) -> torch.Tensor:
    """sum_j a_j b_j in fp32 as chain.cu's consumer threads make it: thread t takes j = t, t + threads, ... (pairs:
    j = 2 q, 2 q + 1 for q = t, t + threads, ..., as `attnres_x`), fmaf in that order from 0, then a butterfly in each
    warp of 32 (lane 0's view), then the warps' sums in order from 0. a, b: [n] fp32. (The orders `rms_norm_x` and
    `attnres_x` sum in: bit for bit, given IEEE fp32 ops.)"""
    n = a.numel()
    e = -(-n // threads)
    t = torch.arange(threads, device=a.device)[None]
    u = torch.arange(e + e % 2 if pairs else e, device=a.device)[:, None]
    j = 2 * (t + (u // 2) * threads) + u % 2 if pairs else t + u * threads      # [u, thread]
    ok = j < n
    A = torch.where(ok, a.float()[j.clamp(max=n - 1)], 0.0)
    B = torch.where(ok, b.float()[j.clamp(max=n - 1)], 0.0)
    acc = torch.zeros(threads, device=a.device)
    for k in range(A.shape[0]):             # (padding: fmaf(0, 0, acc) = acc)
        acc = fma32(A[k], B[k], acc)
    w = acc.view(-1, 32)
    lane = torch.arange(32, device=a.device)
    for o in (16, 8, 4, 2, 1):
        w = w + w[:, lane ^ o]
    total = torch.zeros((), device=a.device)
    for v in w[:, 0]:
        total = total + v
    return total


def rms_norm_k3(u: torch.Tensor, w: torch.Tensor, eps: float, pairs: bool = False) -> torch.Tensor:
    """chain.cu's `rms_norm_x` (as `RMSNorm` rounds): bf16(w bf16(u rsqrt(mean(u^2) + eps))), the sum of squares in
    the kernel's order (`block_dot_k3`; pairs: `attnres_x`'s). u: bf16 values."""
    ss = block_dot_k3(u, u, pairs=pairs)
    r = torch.rsqrt(ss / torch.tensor(float(u.numel()), device=u.device) + eps)
    return bf16r(w.float() * bf16r(u * r))


def attnres_k3(bank: list[torch.Tensor], p_prev: torch.Tensor | None, y: torch.Tensor | None, res_norm, res_query,
               out_norm, eps: float, out_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Block AttnRes as the model computes it (`plugins/attn_res/naive.py`, `attn_res_add_norm_ref`), on bf16
    values, in chain.cu's `attnres_x` order: p = bf16(p_prev + y), per source (the bank rows, then p) its score
    rsqrt(mean(v^2) + eps) (v . res_norm res_query) with the sums in the kernel's order (`block_dot_k3`, pairs), the
    softmax (max, exp, the sum in source order, divisions), the mix sum_s w_s v_s in source order (fp32, no FMA),
    rounded, then RMSNorm (`rms_norm_k3`). With no bank row the softmax is one weight of 1: x = RMSNorm(p), as the
    model's first layer computes it. Returns (x, p)."""
    p = p_prev if y is None else bf16r((p_prev if p_prev is not None else 0.0) + y)
    if bank:
        V = [v.float() for v in [*bank, p]]
        gw = res_norm.float() * res_query.float().reshape(-1)
        d = torch.tensor(float(p.numel()), device=p.device)
        dot = lambda u, w: block_dot_k3(u, w, pairs=True)
        sc = [torch.rsqrt(dot(v, v) / d + eps) * dot(v, gw) for v in V]
        mx = torch.stack(sc).max()
        e = [torch.exp(s - mx) for s in sc]
        tot = torch.zeros((), device=p.device)
        for v in e:
            tot = tot + v
        acc = torch.zeros_like(V[0])
        for es, v in zip(e, V):
            acc = acc + (es / tot) * v
        mix = bf16r(acc)
    else:
        mix = p
    x = rms_norm_k3(mix, out_norm, out_eps, pairs=True)
    return x, p


class Buffers:
    """Every phase's weights in one bf16 buffer (the chain's given weights, else N(0, 1/k): y stays O(1) along the
    chain), outputs in one buffer of 8-byte words {fp32 value, u32 epoch of the launch that wrote it}, the external
    input, the table the kernel reads (int64 [phases, len(FIELDS)]) and the x recipes (`XSeg`, 64 bytes each) with
    their weights. `xdump`: where a check launch writes the x of each recipe (bf16 [phases, XDUMP_SLOTS, XMAX])."""

    def __init__(self, chain: Chain, device: str = "cuda", seed: int = 0):
        self.chain = chain
        g = torch.Generator(device=device).manual_seed(seed)
        self.w_off, self.y_off, nw, ny = [], [], 0, 0
        for p in chain.phases:
            self.w_off.append(nw)
            self.y_off.append(ny)
            nw += -(-p.weight_elems // 8) * 8          # 16-byte aligned starts
            ny += -(-p.words // 4) * 4
        self.w = torch.empty(max(nw, 8), dtype=torch.bfloat16, device=device)
        for i, (p, off) in enumerate(zip(chain.phases, self.w_off)):
            if p.weight_elems:
                v = self.w[off:off + p.weight_elems]
                if i in chain.init:
                    v.copy_(chain.init[i].reshape(-1))
                else:
                    v.copy_(torch.randn(p.weight_elems, generator=g, device=device) / math.sqrt(p.k))
        self.y = torch.zeros(max(ny, 4), dtype=torch.int64, device=device)
        self.values = self.y.view(torch.float32)[0::2]      # the low (little-endian first) half of each word
        self.x = torch.randn(chain.x_len, generator=g, device=device)
        rows = []
        for p, wo, yo in zip(chain.phases, self.w_off, self.y_off):
            v = dict(dataclasses.asdict(p), kind=KINDS[p.kind], w=self.w.data_ptr() + 2 * wo,
                     y=self.y.data_ptr() + 8 * yo)
            rows.append([v[f] for f in FIELDS])
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        self.w_packed, self.w_packed_min_k = None, None
        # a KDA step's tensors: its tiles (f_b's rows and the state's columns, chain.cu `KdaAux`), its conv window
        # in two copies (a launch reads copy epoch & 1, writes the other: `kda_conv_out`), its other tensors, and the
        # values every check launch starts from (`kda_init`; `clear` puts them back)
        self.kda, self.kda_init, self.kda_conv_out = {}, {}, 1
        for p, ph in enumerate(chain.phases):
            if ph.kind == "kda":
                t = {k: v.to(device, KDA_TENSORS[k]) for k, v in chain.xsegs[ph.xop].tensors.items()}
                H = t["state"].shape[0]
                tiles = torch.empty(H, KDA_HEAD // KDA_COLS, KDA_TILE // 4, device=device)
                tiles[..., :KDA_FB_BYTES // 4] = t["f_b"].reshape(H, 1, -1).contiguous().view(torch.float32)
                self.kda[p] = {"tiles": tiles, "conv2": torch.stack([t["conv_state"]] * 2).contiguous(),
                               **{k: t[k].contiguous() for k in ("conv_weight", "a_log", "dt_bias", "f_b")}}
                self.kda_init[p] = {"state": t["state"].contiguous(), "conv_state": t["conv_state"].contiguous()}
                self.kda_set_state(p, t["state"])
                self.table[p, FIELDS.index("w")] = tiles.data_ptr()
        # an attn phase's cache (its "weights"; the launch writes the new row at cache_len) and its first rows
        self.cache = {p: c["cache"].to(device, torch.bfloat16).contiguous() for p, c in chain.caches.items()}
        self.cache_init = {p: c.clone() for p, c in self.cache.items()}
        for p, c in self.cache.items():
            self.table[p, FIELDS.index("w")] = c.data_ptr()
        kda_of = {ph.xop: p for p, ph in self.kda_phases()}
        aux_of = lambda p: [self.kda[p]["conv2" if k == "conv_state" else k].data_ptr() for k in KDA_AUX]
        self.mix_tensors = {}
        self.aux = [torch.tensor(aux_of(kda_of[i]), dtype=torch.int64, device=device) if xs.op == "kda" else
                    self._mix_aux(xs.src, device) if xs.op == "attnres" else
                    None if xs.aux is None else
                    xs.aux.detach().to(device, torch.float32 if xs.op == "score" else torch.bfloat16).contiguous()
                    for i, xs in enumerate(chain.xsegs)]
        raw = b"".join(xs.packed(0 if a is None else a.data_ptr()) for xs, a in zip(chain.xsegs, self.aux))
        self.xsegs = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device) if raw
                      else torch.zeros(XSEG_BYTES, dtype=torch.uint8, device=device))
        self.xdump = (torch.zeros(len(chain.phases), XDUMP_SLOTS, XMAX, dtype=torch.bfloat16, device=device)
                      if chain.xsegs else None)
        self.dumped = False         # xdump holds the last check launch's x (x_of reads it for recipe phases)

    def _mix_aux(self, mix: int, device: str) -> torch.Tensor:
        """Mix phase `mix`'s chain.cu `MixAux` (its score weights gw = res_norm res_query and the norm's weight kept
        in `mix_tensors`), as bytes on the device."""
        m, d = self.chain.mixes[mix], self.chain.phases[mix].n // 2
        if mix not in self.mix_tensors:
            gw = (m.res_norm.float() * m.res_query.float().reshape(-1) if m.bank else torch.zeros(d))
            self.mix_tensors[mix] = (gw.to(device, torch.float32).contiguous(),
                                     m.out_norm.detach().to(device, torch.bfloat16).contiguous())
        gw, ow = self.mix_tensors[mix]
        ref = lambda r: (-2, 0) if r is None else (-1, 0) if r == "input" else (int(r[0]), int(r[1]))
        bank = [ref(b) for b in m.bank] + [(0, 0)] * (MIX_BANK - len(m.bank))
        raw = struct.pack(MIX_AUX, gw.data_ptr(), ow.data_ptr(), len(m.bank), len(m.y), *[b[0] for b in bank],
                          *[b[1] for b in bank], *ref(m.p_prev), *(list(m.y) + [0] * (MIX_Y - len(m.y))), m.eps,
                          m.out_eps, self.chain.mix_writers().get(mix, -1), 0)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)

    def kda_phases(self):
        return [(p, ph) for p, ph in enumerate(self.chain.phases) if ph.kind == "kda"]

    def _state_part(self, p: int) -> torch.Tensor:
        tiles = self.kda[p]["tiles"]
        return tiles[..., KDA_FB_BYTES // 4:].unflatten(-1, (KDA_HEAD, KDA_COLS))     # [H, quarter, k, column]

    def kda_state(self, p: int) -> torch.Tensor:
        """KDA phase p's state as the kernel left it, [H, 128 k, 128 v] (a copy)."""
        return self._state_part(p).permute(0, 2, 1, 3).reshape(-1, KDA_HEAD, KDA_HEAD)

    def kda_set_state(self, p: int, state: torch.Tensor) -> None:
        self._state_part(p).copy_(state.unflatten(-1, (-1, KDA_COLS)).permute(0, 2, 1, 3))

    def kda_conv(self, p: int) -> torch.Tensor:
        """KDA phase p's conv window as the last launch wrote it (a view)."""
        return self.kda[p]["conv2"][self.kda_conv_out]

    def use_mma_layout(self, min_k: int | None) -> None:
        """Point the table at the weights as chain.cu reads them: with -DMMA_TILES=1 (`min_k` its MMA_MIN_K), a copy
        whose tiles are packed for it (made once per min_k); None: the plain weights. `weights` and the reference
        always read the plain ones."""
        if min_k is not None and (self.w_packed is None or self.w_packed_min_k != min_k):
            self.w_packed, self.w_packed_min_k = self.w.clone(), min_k
            for ph, off in zip(self.chain.phases, self.w_off):
                if ph.weight_elems:
                    v = self.w[off:off + ph.weight_elems].view(-1, ph.k)   # (routed: every expert's rows)
                    self.w_packed[off:off + ph.weight_elems] = pack_mma_tiles(v, ph.rows, min_k).reshape(-1)
        base = (self.w_packed if min_k is not None else self.w).data_ptr()
        self.table[:, FIELDS.index("w")] = torch.tensor([self.kda[p]["tiles"].data_ptr() if p in self.kda else
                                                         self.cache[p].data_ptr() if p in self.cache else
                                                         base + 2 * off for p, off in enumerate(self.w_off)],
                                                        dtype=torch.int64, device=self.table.device)

    def weights(self, p: int) -> torch.Tensor:
        ph = self.chain.phases[p]
        shape = (ph.n_experts, ph.ne, ph.k) if ph.kind == "routed" else (ph.n, ph.k)
        return self.w[self.w_off[p]:self.w_off[p] + ph.weight_elems].view(shape)

    def out(self, p: int) -> torch.Tensor:
        """Phase p's output values (a view)."""
        return self.values[self.y_off[p]:self.y_off[p] + self.chain.phases[p].words]

    def clear(self) -> None:
        """Every output NaN and of no launch (epoch 0), so that an unwritten row shows; each KDA step's state and
        conv window back to their first values."""
        for p, init in self.cache_init.items():
            self.cache[p].copy_(init)
        for p, init in self.kda_init.items():
            self.kda_set_state(p, init["state"])
            self.kda[p]["conv2"].copy_(init["conv_state"].expand_as(self.kda[p]["conv2"]))
        self.y.zero_()
        self.values.fill_(float("nan"))
        if self.xdump is not None:
            self.xdump.fill_(float("nan"))
        self.dumped = False

    def recipe_x(self, p: int, slot: int = 0) -> torch.Tensor:
        """Phase p's x by its recipe, from the outputs now in the buffers, as chain.cu computes it (op for op,
        except the RMSNorm's sum of squares, summed here in another order). A top-k's: its keys, then its scores."""
        ph, parts = self.chain.phases[p], []
        for xs, aux in zip(self.chain.xsegs[ph.xop:ph.xop + ph.nxseg], self.aux[ph.xop:ph.xop + ph.nxseg]):
            src = self.out(xs.src)
            j = torch.arange(xs.len, device=src.device)
            if xs.op == "glu":
                a, b = src[xs.off + slot * xs.stride + j], src[xs.off + slot * xs.stride + xs.off2 + j]
                if xs.round_in:
                    a, b = bf16r(a), bf16r(b)
                parts.append(bf16r(situ_glu_k3(a, b, xs.beta, xs.lb)))
            elif xs.op == "combine_norm":
                rt = self.chain.phases[xs.route]
                w = self.out(xs.route)[rt.ne:rt.ne + xs.nslot]
                acc = torch.zeros(xs.len, device=src.device)
                for s in range(xs.nslot):                       # slot order, one fmaf each
                    acc = fma32(w[s].expand(xs.len), src[xs.off + s * xs.stride + j], acc)
                parts.append(rms_norm_k3(bf16r(acc), aux, xs.eps))
            elif xs.op == "sum":
                u = self.out(xs.src)[xs.off + j]
                for q in range(xs.src + 1, xs.src + xs.nslot):
                    u = u + self.out(q)[xs.off + j]
                parts.append(bf16r(u))
            elif xs.op == "norm":
                u = src[xs.off + j] + (self.out(xs.route)[xs.off2 + j] if xs.route >= 0 else 0.0)
                parts.append(rms_norm_k3(bf16r(u), aux, xs.eps))
            elif xs.op == "attnres":
                parts.append(self.mix_out(xs.src)[:xs.len])
            elif xs.op == "mla_q":                              # the head group's [ql | q_pe] a head
                hw = xs.len // xs.nslot
                pe, qb = hw - xs.stride, self.out(xs.route)
                q = [torch.cat([src[xs.off + h * xs.stride:xs.off + (h + 1) * xs.stride],
                                qb[h * (xs.off2 + pe) + xs.off2:(h + 1) * (xs.off2 + pe)]])
                     for h in range(slot * xs.nslot, (slot + 1) * xs.nslot)]
                parts.append(bf16r(torch.cat(q)))
            elif xs.op == "mla_combine":                        # the head's key blocks that hold keys, in order
                live = min(xs.nslot, self.chain.phases[xs.src].live_blocks)   # (the others add 0)
                w = src[xs.off + slot * (xs.len + 2):].unfold(0, xs.len + 2, xs.stride)[:live]
                m, l, o = w[:, 0], w[:, 1], w[:, 2:]
                a = torch.exp(m - m.max())
                den, acc = torch.zeros((), device=w.device), torch.zeros(xs.len, device=w.device)
                for q in range(live):
                    den = den + a[q] * l[q]
                    acc = acc + a[q] * o[q]
                parts.append(bf16r(acc / den))
            elif xs.op == "gate":
                parts.append(bf16r(sigmoid_k3(bf16r(self.out(xs.route)[xs.off2 + j])) * bf16r(src[xs.off + j])))
            elif xs.op == "headnorm":
                parts.append(kda_headnorm_k3(src[xs.off + j], bf16r(self.out(xs.route)[xs.off2 + j]), aux, xs.eps))
            else:                                               # score
                sc = sigmoid_k3(src[xs.off + j])
                parts.append(torch.cat([sc + aux, sc]))
        return torch.cat(parts)

    def x_of(self, p: int, slot: int = 0) -> torch.Tensor:
        """Phase p's input as the kernel reads it: x[j] = y_src[slot * xstride + j % xlen] (+ y_dep2[j % xlen2]),
        rounded to bf16 for a GEMV; by its recipe where it has one (after a check launch: the kernel's own x)."""
        ph = self.chain.phases[p]
        if ph.xop >= 0:
            if self.dumped and ph.kind != "topk":
                return self.xdump[p, slot, :self.x_width(p)].float()
            return self.recipe_x(p, slot)
        src = self.x if ph.src < 0 else self.out(ph.src)
        j = torch.arange(ph.xlen if ph.kind == "topk" else ph.k, device=src.device)
        x = src[slot * ph.xstride + j % ph.xlen]
        if ph.dep2 >= 0:
            x = x + self.out(ph.dep2)[j % ph.xlen2]
        return x if ph.kind == "topk" else x.bfloat16().float()     # a GEMV's x as a bf16 model feeds it

    def set_cache_len(self, cache_len: int) -> None:
        """Every attention phase's keys for the next launch: its cache's rows [:cache_len] and the new row (appended
        at cache_len), up to its capacity (`Chain.attn`); the table's n, which the kernel reads."""
        for p, c in self.chain.caches.items():
            if not 0 <= cache_len < c["capacity"]:
                raise ValueError(f"{self.chain.phases[p].name}: cache_len {cache_len}; its tiles hold "
                                 f"{c['capacity']} keys")
            self.chain.phases[p].n = cache_len + 1
            self.table[p, FIELDS.index("n")] = cache_len + 1

    def advance(self, move: bool = True) -> None:
        """After a launch: its states (KDA state and conv window, the caches with their new rows) become where the
        next launch starts (what `clear` puts back and the checks start from); with `move`, the caches' cache_len
        moves on (the caller sets it otherwise: after a sequence's last row there is no next launch)."""
        for p in self.kda_init:
            self.kda_init[p] = {"state": self.kda_state(p).contiguous(), "conv_state": self.kda_conv(p).clone()}
        for p in self.cache:
            n = self.chain.phases[p].n                   # (only the launch's new row changed)
            self.cache_init[p][n - 1] = self.cache[p][n - 1]
        if self.chain.caches and move:
            self.set_cache_len(self.chain.cache_len(next(iter(self.chain.caches))) + 1)

    def x_width(self, p: int) -> int:
        """The length of phase p's x (attn: its head group's queries and the new row)."""
        ph = self.chain.phases[p]
        return (ph.heads + 1) * ph.k if ph.kind == "attn" else ph.xlen if ph.kind == "topk" else ph.k

    def attn_out(self, p: int) -> torch.Tensor:
        """Attn phase p's words from its x (per head group: `x_of`) and the cache as the launch found it, in fp64:
        per tile and head [m, l, O] over the tile's keys (chain.cu's ATTN; its sums are fp32, in other orders)."""
        ph = self.chain.phases[p]
        R, rank, L, A = ph.k, ph.xlen, self.chain.cache_len(p), ph.heads
        scale = self.chain.xsegs[ph.xop].scaling
        out = []
        for t in range(ph.ntiles):
            x = self.x_of(p, t % ph.ne).double()
            q, new = x[:A * R].view(A, R), x[A * R:]
            r0 = (t // ph.ne) * ph.rows
            keys = torch.cat([self.cache_init[p][:L].double(), new[None]])[r0:r0 + ph.rows]
            if not len(keys):                   # (a block past the keys: max -inf, sum and output 0)
                out.append(torch.cat([torch.full((A, 1), -math.inf, dtype=torch.float64, device=x.device),
                                      torch.zeros(A, rank + 1, dtype=torch.float64, device=x.device)], 1))
                continue
            s = (q @ keys.T) * float(torch.tensor(scale, dtype=torch.float32))
            m = s.max(dim=1).values
            e = torch.exp(s - m[:, None])
            out.append(torch.cat([m[:, None], e.sum(1)[:, None], e @ keys[:, :rank]], dim=1))
        return torch.cat(out).reshape(-1).float()

    def kda_inputs(self, p: int) -> dict:
        """KDA phase p's inputs from the words now in the buffers and its tensors' first values (`kda_init`: what a
        launch after `clear` starts from): the arguments of `kda_step_k3`."""
        ph, xs = self.chain.phases[p], self.chain.xsegs[self.chain.phases[p].xop]
        H, K, t = xs.nslot, KDA_HEAD, self.kda[p]
        words = bf16r(self.out(xs.src))
        return dict(qkv=words[xs.off:xs.off + 3 * H * K], conv_state=self.kda_init[p]["conv_state"],
                    conv_weight=t["conv_weight"], f_a=words[xs.route:xs.route + K], f_b=t["f_b"],
                    b=words[xs.stride:xs.stride + H], a_log=t["a_log"], dt_bias=t["dt_bias"],
                    state=self.kda_init[p]["state"], lb=xs.lb)

    def _vector(self, ref, d: int) -> torch.Tensor | None:
        if ref is None:
            return None
        if ref == "input":
            return bf16r(self.x[:d])
        if ref[0] in self.chain.mixes:
            return self.mix_words(ref[0])[1]
        return self.out(ref[0])[ref[1]:ref[1] + d]

    def mix_words(self, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix phase q's words as written: x (d fp32 words) and p, packed after it two bf16 a word ({p[2 i],
        p[2 i + 1], epoch}: chain.cu's `attnres_x`), as fp32 [d] each."""
        d, o = self.chain.phases[q].n // 2, self.y_off[q]
        pw = self.y[o + d:o + d + d // 2].view(torch.bfloat16).view(-1, 4)[:, :2].reshape(-1).float()
        return self.values[o:o + d], pw

    def set_mix(self, q: int, x: torch.Tensor, p: torch.Tensor) -> None:
        """Write mix phase q's words (x, then p packed) as the kernel does, keeping each word's epoch."""
        d, o = self.chain.phases[q].n // 2, self.y_off[q]
        self.values[o:o + d] = x
        bits = p.bfloat16().view(torch.int16).to(torch.int64) & 0xFFFF
        low = bits[0::2] | (bits[1::2] << 16)
        w = self.y[o + d:o + d + d // 2]
        w.copy_((w & ~0xFFFFFFFF) | low)

    def mix_out(self, p: int) -> torch.Tensor:
        """A "mix" phase's [x | p] from the vectors now in the buffers (`attnres_k3`)."""
        m, d = self.chain.mixes[p], self.chain.phases[p].n // 2
        y = None
        if m.y:
            y = self.out(m.y[0])[:d]
            for q in m.y[1:]:
                y = y + self.out(q)[:d]
            y = bf16r(y)
        x, pv = attnres_k3([self._vector(b, d) for b in m.bank], self._vector(m.p_prev, d), y, m.res_norm,
                           m.res_query, m.out_norm, m.eps, m.out_eps)
        return torch.cat([x, pv])

    def expected(self, p: int) -> torch.Tensor:
        """Phase p's output from the inputs now in the buffers (fp32 accumulation; top-k: ids as floats; KDA: after
        a launch that followed `clear`)."""
        ph, xs = self.chain.phases[p], None
        if ph.kind == "mix":
            return self.mix_out(p)
        if ph.kind == "mla":
            m, d = self.chain.mlas[p], self.chain.phases[p].n - self.chain.mlas[p]["cache"].shape[1]
            x = self.out(ph.src)[:d].bfloat16()[None]
            with torch.no_grad():
                y, row = m["attn"].decode(x, m["cache"].to(x.device)[None],
                                          torch.tensor([m["cache_len"]], device=x.device))
            return torch.cat([y[0].float(), row[0].float()])
        if ph.kind == "kda":
            return kda_step_k3(**self.kda_inputs(p))[0]
        if ph.kind == "attn":
            return self.attn_out(p)
        if ph.kind == "topk" and ph.xop >= 0:
            return self.scored_topk(p)
        if ph.kind == "topk":
            return torch.topk(self.x_of(p), ph.ne).indices.float()       # (descending, as the kernel's rounds)
        if ph.kind == "gemv":
            return self.weights(p).float() @ self.x_of(p)
        ids = (torch.arange(ph.n_experts) if ph.route < 0 else                  # (a fixed route: every expert)
               self.out(ph.route)[:self.chain.phases[ph.route].ne].long())      # (a scored top-k: then weights)
        xs = [self.x_of(p, s) for s in range(len(ids))]
        return torch.cat([self.weights(p)[e].float() @ (xs[s] if ph.xstride else xs[0]) for s, e in enumerate(ids)])

    def scored_topk(self, p: int) -> torch.Tensor:
        """A top-k with a "score" recipe: the ids of the k largest keys (ties: the lower id), then their weights
        (the unbiased scores, summed in slot order, renormalised, times scaling), as chain.cu's ranks give them."""
        ph, xs = self.chain.phases[p], self.chain.xsegs[self.chain.phases[p].xop]
        x = self.x_of(p)
        keys, scores = x[:ph.xlen], x[ph.xlen:]
        ids = torch.sort(keys, descending=True, stable=True).indices[:ph.ne]
        chosen = scores[ids]
        total = torch.zeros((), device=x.device)
        for v in chosen:
            total = total + v
        w = chosen / (total + torch.tensor(1e-20, device=x.device)) if xs.renorm else chosen
        return torch.cat([ids.float(), w * torch.tensor(xs.scaling, device=x.device)])

    def recipe_errors(self) -> dict:
        """After a check launch: per phase with a recipe (and x slot), how many of the kernel's x values differ from
        `recipe_x` on the kernel's own inputs, and by how much at most."""
        out = {}
        for p, ph in enumerate(self.chain.phases):
            if ph.xop < 0 or ph.kind in ("topk", "kda"):
                continue
            slots = self.chain.slots(ph)
            for s in range(slots):
                got, ref = self.xdump[p, s, :self.x_width(p)].float(), self.recipe_x(p, s)
                diff = (got - ref).abs()
                out[f"{ph.name}[{s}]" if slots > 1 else ph.name] = {
                    "differ": int((diff > 0).sum()) + int(torch.isnan(got).sum()), "of": self.x_width(p),
                    "max_abs": float(diff.nan_to_num(float("inf")).max())}
        return out

    def run_reference(self) -> None:
        """Fill every output in chain order, as the kernel should (and update each KDA step's state and conv window
        as the kernel does, from their first values)."""
        for p, ph in enumerate(self.chain.phases):
            if ph.kind == "kda":
                o, state, conv = kda_step_k3(**self.kda_inputs(p))
                self.out(p).copy_(o)
                self.kda_set_state(p, state)
                self.kda_conv(p).copy_(conv)
            elif ph.kind == "mix":
                v = self.mix_out(p)
                self.set_mix(p, v[:ph.n // 2], v[ph.n // 2:])
            else:
                self.out(p).copy_(self.expected(p))
                if ph.kind == "attn":       # (the new row: the x's last k values)
                    self.cache[p][ph.n - 1] = self.x_of(p)[ph.heads * ph.k:].bfloat16()

    def kda_errors(self, p: int) -> dict:
        """After a launch that followed `clear`: KDA phase p against `kda_step_k3` on the kernel's own inputs. Its
        output (bf16 values): elements that differ and the largest difference in bf16 ulps; the new state: the
        largest |difference| / max |state|; the new conv window: elements that differ (it is copied: none)."""
        o, state, conv = kda_step_k3(**self.kda_inputs(p))
        got = self.out(p)
        ulp = 2.0 ** (torch.floor(torch.log2(o.abs().clamp_min(2.0 ** -126))) - 7)
        return {"o_differ": int((got != o).sum()), "o_max_ulps": float(((got - o).abs() / ulp).max()),
                "o_max_rel": float((got - o).abs().max() / o.abs().max().clamp_min(1e-30)),
                "state_max_rel": float((self.kda_state(p) - state).abs().max() / state.abs().max().clamp_min(1e-30)),
                "conv_differ": int((self.kda_conv(p) != conv).sum())}

    def errors(self) -> dict:
        """Per kind, the largest |y - expected| / max|expected| over phases (expected from the kernel's own
        inputs), the top-k phases that differ, and the phases with unwritten (NaN) rows; per KDA phase
        `kda_errors` (not in max_rel: its bounds are `KDA_BOUNDS`)."""
        worst = {k: 0.0 for k in KINDS if k not in ("kda", "mix", "mla")}
        topk_wrong, nan, kda, mix, cache_row = [], [], {}, {}, []
        writers = self.chain.mix_writers()
        for p, ph in enumerate(self.chain.phases):
            if (ph.kind == "mix" and p not in writers) or ph.kind == "mla":
                continue                    # (emulated only: no kernel writes them)
            got = torch.cat(self.mix_words(p)) if ph.kind == "mix" else self.out(p)
            if ph.kind == "attn":               # (the key blocks that hold keys; `LIVE_SPLITS` writes no others)
                got = got[:ph.live_blocks * ph.ne * ph.heads * (ph.xlen + 2)]
            if torch.isnan(got).any():
                nan.append(ph.name)
                continue
            if ph.kind == "kda":
                kda[ph.name] = self.kda_errors(p)
                continue
            if ph.kind == "mix":
                mix[ph.name] = self.mix_errors(p)
                continue
            ref = self.expected(p)
            if ph.kind == "topk":
                if not torch.equal(got, ref):     # (a scored top-k's weights too: the same ops on the same inputs)
                    topk_wrong.append(ph.name)
                continue
            if ph.kind == "attn":               # (empty key blocks: max -inf in both)
                ref = ref[:len(got)]
                same = (got == ref) & torch.isinf(ref)
                if (torch.isinf(ref) != same).any():
                    topk_wrong.append(ph.name)
                got, ref = got.masked_fill(same, 0.0), ref.masked_fill(same, 0.0)
            rel = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            worst[ph.kind] = max(worst[ph.kind], rel)
            if ph.kind == "attn" and not torch.equal(self.cache[p][ph.n - 1].float(),
                                                     self.x_of(p)[ph.heads * ph.k:]):
                cache_row.append(ph.name)       # (the new row the launch appended: the x's, as it read it)
        out = {"max_rel": worst, "topk_wrong": topk_wrong + cache_row, "unwritten": nan, "kda": kda,
               "kda_out_of_bounds": [k for k, v in kda.items() if any(v[b] > KDA_BOUNDS[b] for b in KDA_BOUNDS)]}
        if mix:
            out["mix"] = mix
            out["mix_out_of_bounds"] = [k for k, v in mix.items() if any(v[b] > MIX_BOUNDS[b] for b in MIX_BOUNDS)]
        return out

    @staticmethod
    def failed(e: dict) -> bool:
        """Whether `errors()`' result e fails the kernel: unwritten rows, a wrong top-k (or attention -inf / appended
        row), a KDA step or mix out of its bounds, or a phase past CHECK_REL."""
        return bool(e["unwritten"] or e["topk_wrong"] or e["kda_out_of_bounds"] or e.get("mix_out_of_bounds")
                    or max(e["max_rel"].values()) > CHECK_REL)

    def mix_errors(self, p: int) -> dict:
        """A mix phase's words as its writer left them against `mix_out` on the kernel's own inputs: p (exact: one
        rounded add) and x (elements that differ, the largest difference in bf16 steps)."""
        d, ref = self.chain.phases[p].n // 2, self.mix_out(p)
        x, pv = self.mix_words(p)
        return {"p_differ": int((pv != ref[d:]).sum()), "x_differ": int((x != ref[:d]).sum()),
                "x_max_ulps": bf16_ulps(x, ref[:d])}


def attn_scratch_bytes(heads: int, k: int, rows: int, kchunks: int = 0) -> int:
    """Bytes an ATTN tile uses of x's shared memory (chain.cu `attn_tile`): its x (the head group's queries and the
    new row, bf16, to 16 bytes), the [heads][rows] fp32 scores, and with ATTN_MMA the scores' `kchunks` partials."""
    return ((heads + 1) * k * 2 + 15) // 16 * 16 + (1 + kchunks) * heads * rows * 4


def attn_mma_refusal(chain: Chain, kchunks: int) -> str | None:
    """Why chain.cu built with ATTN_MMA (`attn_tile` on tensor cores: m16n8k16, the scores' k over `kchunks` warps
    per key block, their sums in x's scratch) cannot run `chain`'s attention phases (None: it can)."""
    for ph in chain.phases:
        if ph.kind != "attn":
            continue
        need = attn_scratch_bytes(ph.heads, ph.k, ph.rows, kchunks)
        if ph.heads != 8 or ph.rows != 32 or ph.k % 16 or ph.xlen % 16 or need > XMAX * 2:
            return (f"{ph.name}: chain.cu built with ATTN_MMA takes tiles of 8 heads and 32 keys, rows and rank "
                    f"multiples of 16, and {need} bytes of x and scratch within {XMAX * 2}; this phase has "
                    f"{ph.heads} heads, {ph.rows} keys, rows of {ph.k}, rank {ph.xlen}")
    return None


def bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |got - ref| in units of ref's bf16 spacing there (NaN: inf)."""
    ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -126))) - 7)
    return float(((got - ref).abs() / ulp).nan_to_num(float("inf")).max()) if ref.numel() else 0.0


def mma_tile(rows: int, rows_here: int, k: int, min_k: int = 32) -> bool:
    """chain.cu -DMMA_TILES=1 (-DMMA_MIN_K=`min_k`) sums a tile on tensor cores, from a packed tile
    (`pack_mma_tiles`), when this holds (chain.cu's `mma_tile`)."""
    return rows % 16 == 0 and rows_here == rows and k % 32 == 0 and k >= min_k


def mma_min_k(defines: tuple[str, ...], cu: Path = CU) -> int | None:
    """A build's MMA_MIN_K where it sums on tensor cores (chain.cu's MMA_TILES: on by default, off by default
    beside WARP_ROWS or TILE_IN_REGS, off in a chain.cu without it), else None."""
    if any(d.startswith("MMA_TILES=") for d in defines):
        mma = define_value(defines, "MMA_TILES", cu)
    elif any(define_value(defines, name, cu, default=0) for name in ("WARP_ROWS", "TILE_IN_REGS")):
        mma = 0
    else:
        mma = cu_default("MMA_TILES", cu, default=0)
    return define_value(defines, "MMA_MIN_K", cu, default=32) if mma else None


def pack_mma_tiles(w: torch.Tensor, rows: int, min_k: int = 32) -> torch.Tensor:
    """w [N, k] (a phase's weights, tiles of `rows` rows) with each tile that `mma_tile` takes reordered as chain.cu's
    `mma_partials` reads it: 16-byte chunks in the order [row block rb][k block kb][half][g][q], the chunk holding
    row 16 rb + 8 half + g, columns 32 kb + 8 q .. + 7. A last tile with fewer rows stays as it is."""
    n, k = w.shape
    out = w.clone()
    full = n // rows
    if full and mma_tile(rows, rows, k, min_k):
        t = w[:full * rows].reshape(full, rows // 16, 2, 8, k // 32, 4, 8)
        out[:full * rows] = t.permute(0, 1, 4, 2, 3, 5, 6).reshape(full * rows, k)
    return out


def tile_row0(ph: Phase, t: int, nblk: int, paired: bool = False) -> int:
    """chain.cu's `tile_row0`: the first row of phase ph's tile t on nblk blocks; paired (a PAIR_TILES=1 build): in a
    routed phase with x per expert over more tiles than blocks, block c's tiles t = c, c + nblk, ... are row blocks
    in a run (runs of R = ceil(ntiles / nblk) for the first F = ntiles - (R - 1) nblk columns, then of R - 1)."""
    if paired and ph.kind == "routed" and ph.xstride and ph.ntiles > nblk:
        R = -(-ph.ntiles // nblk)
        F, r, c = ph.ntiles - (R - 1) * nblk, t // nblk, t % nblk
        return (c * R + r if c < F else F * R + (c - F) * (R - 1) + r) * ph.rows
    return t * ph.rows


def phase_stride(ph: Phase, nblk: int) -> int:
    """chain.cu's `phase_stride`: the blocks phase ph's tiles are dealt over (from block tile0 mod nblk on)."""
    return nblk - ph.spare if ph.spare and 4 * (nblk - ph.spare) >= nblk else nblk


def tile_block(ph: Phase, t: int, nblk: int) -> int:
    """The block that runs phase ph's tile t on nblk blocks (chain.cu `first_tile`)."""
    return (ph.tile0 + t % phase_stride(ph, nblk)) % nblk


def block_tiles(chain: Chain, nblk: int, paired: bool = False) -> list[list[tuple[int, int, int]]]:
    """Per block, its tiles in the order chain.cu walks them: (phase, x slot, weight bytes); paired: a PAIR_TILES=1
    build's (`tile_row0`)."""
    out = [[] for _ in range(nblk)]
    for p, ph in enumerate(chain.phases):
        for t in range(ph.ntiles):
            row0 = tile_row0(ph, t, nblk, paired)
            slot = row0 // ph.ne if ph.kind == "routed" and ph.xstride else 0
            nbytes = 0 if ph.kind == "topk" else min(ph.rows, ph.n - row0) * ph.k * 2
            if ph.kind == "attn":           # (key block t / ne, head group t % ne; the new row is not loaded)
                slot, row0 = t % ph.ne, t // ph.ne * ph.rows
                nbytes = max(0, min(ph.rows, ph.n - 1 - row0)) * ph.k * 2
            out[tile_block(ph, t, nblk)].append((p, slot, nbytes))
    return out


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [a, b) intervals as disjoint intervals in order."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(merged: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merged)


def _overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Length of the intersection of two `_merged` lists (one sweep)."""
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def tile_pipeline(tr: torch.Tensor, tiles: list[list[tuple[int, int, int]]], bin_us: float = 1.0) -> dict:
    """What the ring of each block did in one launch, from -DTRACE_TILES times (ns; [blocks, tiles, TILE_FIELDS],
    0 where not recorded) and each block's tiles (`block_tiles`). Per block, summed over its tiles and averaged over
    blocks (us): the time its stream was stopped (no copy in flight between its first issue and its last landing),
    and of that the part the producer waited for a free slot (every slot landed or in use: the ring was full); the
    consumers' waits for a tile (the first tile of an x, and the rest), their sums, their gaps between tiles (x loads
    and barriers); the producer's waits for a free slot. Over copies: issue to landing (median, p10, p90). And the
    landed bytes over time across blocks (TB/s per `bin_us`), with the share of bins below half the peak bin."""
    rec = (tr > 0).all(-1)                              # tiles with every time recorded
    # (%globaltimer is ns since an epoch, ~1.7e18: a double holds it to 256 ns, so subtract as integers first)
    t_us = (tr - tr[tr > 0].min()).double() / 1e3
    per = {k: [] for k in ("stream_stopped", "stopped_ring_full", "wait_first_tile", "wait_other_tiles", "sums",
                           "gaps", "producer_waits_for_slot")}
    lat, landed = [], []
    for b, bt in enumerate(tiles):
        n = min(len(bt), tr.shape[1])
        t, ok = t_us[b, :n].tolist(), rec[b, :n].tolist()   # us from the launch's first recorded time
        rows = [(t[i], bt[i]) for i in range(n) if ok[i]]
        if not rows:
            continue
        copies = [(r[ISSUED], r[LANDED]) for r, (_, _, nb) in rows if nb]
        lat += [b2 - a for a, b2 in copies]
        landed += [(r[LANDED], nb) for r, (_, _, nb) in rows if nb]
        if copies:
            first, last = min(a for a, _ in copies), max(b2 for _, b2 in copies)
            busy = _merged(copies)
            per["stream_stopped"].append(last - first - _length(busy))
            # stopped while the producer waited for a free slot: [want, free) minus the copies in flight then
            waits = _merged([(r[WANT], r[FREE]) for r, _ in rows])
            per["stopped_ring_full"].append(_length(waits) - _overlap(waits, busy))
        prev, wf, wo, sums, gaps = None, 0.0, 0.0, 0.0, 0.0
        for r, key in rows:
            w = r[HAVE] - r[TAKE]
            if prev is None or key[:2] != prev[1][:2]:
                wf += w
            else:
                wo += w
            sums += r[DONE] - r[HAVE]
            if prev is not None:
                gaps += r[TAKE] - prev[0][DONE]
            prev = (r, key)
        per["wait_first_tile"].append(wf)
        per["wait_other_tiles"].append(wo)
        per["sums"].append(sums)
        per["gaps"].append(gaps)
        per["producer_waits_for_slot"].append(sum(r[FREE] - r[WANT] for r, _ in rows))
    out = {"per_block_us": {k: statistics.fmean(v) if v else 0.0 for k, v in per.items()},
           "blocks": len(per["sums"])}
    if lat:
        q = torch.tensor(lat)
        out["copy_latency_us"] = {"median": q.median().item(), "p10": q.quantile(0.1).item(),
                                  "p90": q.quantile(0.9).item()}
    if landed:
        nbin = int(max(t for t, _ in landed) // bin_us) + 1
        rate = [0.0] * nbin
        for t, nb in landed:
            rate[int(t // bin_us)] += nb / (bin_us * 1e6)        # TB/s
        peak = max(rate)
        out["landed_tbs"] = rate
        out["bin_us"] = bin_us
        out["bins_below_half_peak"] = sum(r < peak / 2 for r in rate) / nbin
    return out


def compile_cubin(nslot: int, slot_bytes: int, out_dir: str, spin_limit: int | None = None,
                  defines: tuple[str, ...] = (), cu: Path = CU) -> tuple[str, str]:
    """nvcc chain.cu for sm_90a with this ring (and -D`defines`); (cubin path, ptxas's resource report)."""
    tag = "".join("-" + d.replace("=", "") for d in defines)
    path = os.path.join(out_dir, f"{cu.stem}-{nslot}x{slot_bytes}{tag}.cubin")
    cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-cubin", "-Xptxas", "-v",
           f"-DNSLOT={nslot}", f"-DSLOT_BYTES={slot_bytes}", *(f"-D{d}" for d in defines), "-o", path, str(cu)]
    if spin_limit:
        cmd.insert(-3, f"-DSPIN_LIMIT={spin_limit}u")
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{run.stderr}")
    return path, run.stderr


SMEM_LIMIT = 227 * 1024    # sm_90's dynamic shared memory per block
SMEM_PER_SM = 228 * 1024   # ... per SM, 1 KB of it reserved per resident block
REGS_PER_SM = 65536


DEFAULT_RING = f"{cu_default('NSLOT')}x{cu_default('SLOT_BYTES')}"


def row_groups(ph: Phase, consumers: int, steps: int) -> int:
    """How many row groups chain.cu's consumers split one of ph's tiles into (its T and G)."""
    chunks, t = ph.k // 8, 1
    while t * steps < chunks:
        t *= 2
    g = consumers // t
    if g > ph.rows:
        g = ph.rows
    return -(-ph.rows // g)


def smem_bytes(nslot: int, slot_bytes: int, nphase: int, nxseg: int = 0) -> int:
    """chain.cu's shared memory: the ring, x (bf16), the phase table, the x recipes, the ring's barriers."""
    return nslot * slot_bytes + XMAX * 2 + nphase * PHASE_BYTES + nxseg * XSEG_BYTES + 2 * nslot * 8


def too_wide(chain: Chain) -> list[str]:
    """The phase fields (phase.field) that chain.cu's 16-bit PhaseC fields cannot hold."""
    return [f"{ph.name}.{f}" for ph in chain.phases for f in PHASE_INT16 if f != "kind"
            and not -2 ** 15 <= getattr(ph, f) < 2 ** 15]


def not_resident(per_sm: int, threads: int, regs: int, smem: int, static: int = 0) -> str | None:
    """Why `per_sm` blocks (threads, registers a thread, dynamic and static shared memory) cannot all be on one SM,
    or None."""
    if smem + static > SMEM_LIMIT or per_sm * (smem + static + 1024) > SMEM_PER_SM:
        return f"{smem} + {static} (static) bytes of shared memory a block, over what an SM has"
    # registers: each of an SM's 4 sub-partitions holds a quarter of the file and takes every 4th warp, so the
    # fullest holds ceil(warps / 4) of them (17 warps at 104 registers do not launch though 64K would hold them:
    # CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, H100 12-06; ptxas caps 544 threads at 96 for the same reason)
    warps = per_sm * (threads // 32)
    if -(-warps // 4) * (-(-regs * 32 // 256) * 256) > REGS_PER_SM // 4:
        return (f"{threads} threads at {regs} registers a block, over an SM's {REGS_PER_SM} (a quarter to each "
                f"scheduler, {-(-warps // 4)} warps on the fullest)")
    return None


def kernel_report(ptxas: str) -> list[str]:
    """ptxas's lines on chain_kernel itself (its frame and spills, its registers): not those of a function it calls."""
    lines = [ln.strip() for ln in ptxas.strip().splitlines()]
    k = next((i for i, ln in enumerate(lines) if ln.endswith("for chain_kernel")), len(lines) - 3)
    return lines[k + 1:k + 3]


PDL_ATTRIBUTE = 6          # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)


class _LaunchAttribute(ctypes.Structure):          # CUlaunchAttribute: the id, padded to 8 bytes, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):             # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("nattrs", ctypes.c_uint)]


_PDL_ON = _LaunchAttribute(id=PDL_ATTRIBUTE, value=1)      # (the one attribute every PDL launch passes)
_C_TYPES = {"uint64": ctypes.c_uint64, "int64": ctypes.c_int64, "uint32": ctypes.c_uint32, "int32": ctypes.c_int32}
_libcuda = None


def launch_pdl(fn, grid: int, block: int, smem: int, stream: int, args: tuple) -> None:
    """Launch cupy RawKernel `fn` (its CUfunction: `fn.kernel.ptr`) with programmatic dependent launch
    (`cuLaunchKernelEx` through ctypes, as cupy has no launch attributes): it may begin while the kernel before it on
    `stream` still runs, and must wait (`griddepcontrol.wait`) before it reads anything that kernel or an earlier one
    wrote (chain.cu's PDL). args: numpy scalars, in the kernel's order."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                              ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    values = [_C_TYPES[a.dtype.name](a.item()) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    cfg = _LaunchConfig(grid=(ctypes.c_uint * 3)(grid, 1, 1), block=(ctypes.c_uint * 3)(block, 1, 1), shared=smem,
                        stream=stream, attrs=ctypes.pointer(_PDL_ON), nattrs=1)
    err = _libcuda.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(fn.kernel.ptr), params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx (programmatic dependent launch) failed: CUresult {err}")


class ChainKernel:
    """chain.cu compiled for one ring, launched through cupy on torch's current stream (built with PDL: through
    `launch_pdl`)."""

    def __init__(self, nslot: int = 3, slot_bytes: int = 65536, build_dir: str | None = None,
                 spin_limit: int | None = None, defines: tuple[str, ...] = (), cu: Path = CU,
                 cubin: tuple[str, str] | None = None, quiet: bool = False):
        """cubin: (path, ptxas's report) of a build of `cu` with these settings (an engine directory's), instead
        of running nvcc."""
        import cupy
        self.cupy, self.nslot, self.slot_bytes, self.defines, self.cu = cupy, nslot, slot_bytes, defines, cu
        cubin, self.ptxas = cubin or compile_cubin(nslot, slot_bytes, build_dir or tempfile.mkdtemp(prefix="k3chain-"),
                                                   spin_limit, defines, cu)
        if not quiet:
            print(f"{cu.name} {nslot}x{slot_bytes} {' '.join(defines)}: "
                  + " | ".join(kernel_report(self.ptxas)), flush=True)
        self.fn = cupy.RawModule(path=cubin).get_function("chain_kernel")
        self.consumers = 32 * define_value(defines, "CONSUMER_WARPS", cu)
        # + the producer warp (and -DTRACE_TILES's observer warp)
        self.threads = self.consumers + 32 * (2 if "TRACE_TILES" in defines else 1)
        self.steps = define_value(defines, "STEPS", cu)
        self.per_sm = define_value(defines, "BLOCKS_PER_SM", cu, default=1)
        own = " ".join(kernel_report(self.ptxas))
        self.regs = int(re.search(r"Used (\d+) registers", own).group(1))
        self.static_smem = int(re.search(r"(\d+) bytes smem", own).group(1))
        self.blocks = self.per_sm * torch.cuda.get_device_properties(0).multi_processor_count
        self.epoch = 0
        self.counters = self.err = None
        # -DEPOCH_PTR=1: the kernel reads its epoch from `epoch_dev`, which each launch bumps on the device first,
        # so that a CUDA graph of launches replays with a new epoch each time
        self.epoch_ptr = bool(define_value(defines, "EPOCH_PTR", cu, default=0))
        self.epoch_dev = None
        # -DSTEP_INPUTS=1: the launch reads the token's embedding row and the key count itself: `step_args` =
        # (embedding table [V, d] bf16, token ids [>= 1] int64, lengths [>= 1] int64), the engine's own buffers;
        # its epoch is epoch_dev[0] + lengths[0] (`start_sequence` sets the base), so nothing runs between launches
        self.step_inputs = bool(define_value(defines, "STEP_INPUTS", cu, default=0))
        self.step_args = None
        # -DARGMAX=1: a launch with `argmax_args` = (ids [>= 1] int64, host ring [rows, slots] int64 or None, active
        # [>= 1] bool) also writes the greedy token (the first index of the last phase's largest value, NaN as +inf)
        # to ids[0] and the ring's row (lengths[0] + active[0]) mod rows, column 0; None: it does not (the plain step)
        self.argmax = bool(define_value(defines, "ARGMAX", cu, default=0))
        self.argmax_args = None
        # -DCOMMIT_LENGTHS=1 (with STEP_INPUTS): a launch with `commit_active` ([>= 1] bool on the GPU) also adds
        # active[0] to the step_args' lengths[0] once every block has read it (the engine's `lengths.add_(active)`
        # after the step); None: it does not
        self.commit_lengths = bool(define_value(defines, "COMMIT_LENGTHS", cu, default=0))
        self.commit_active = None
        # -DPDL=1 (with STEP_INPUTS): each launch is a programmatic dependent launch (`launch_pdl`), so that its
        # blocks take the SMs, and its producers stream phase 0's weights, while the kernel before it still runs
        self.pdl = bool(define_value(defines, "PDL", cu, default=0))
        # -DSTEP_LOOP=1 (with ARGMAX and COMMIT_LENGTHS): a launch runs `nsteps` greedy steps, each fed the last
        # one's token; more than one needs `argmax_args` and `commit_active` (the tokens and the lengths move in it)
        self.step_loop = bool(define_value(defines, "STEP_LOOP", cu, default=0))
        self.nsteps = 1
        self.am_best = None
        self._argmax_refused = None
        self._streams: dict[int, object] = {}

    def stream(self):
        """cupy's handle of torch's current stream (the one a launch goes to, a capturing one included)."""
        ptr = torch.cuda.current_stream().cuda_stream
        if ptr not in self._streams:
            with warnings.catch_warnings():                  # (cupy 14 prefers Stream.from_external)
                warnings.simplefilter("ignore", DeprecationWarning)
                self._streams[ptr] = self.cupy.cuda.ExternalStream(ptr)
        return self._streams[ptr]

    def bind(self, bufs: Buffers) -> None:
        n = len(bufs.chain.phases)
        if bufs.chain.slot_bytes != self.slot_bytes:
            raise ValueError(f"the chain's tiles are for {bufs.chain.slot_bytes}-byte slots, the kernel's "
                             f"{self.slot_bytes}")
        if bufs.chain.xsegs and not define_value(self.defines, "RECIPES", self.cu, default=0):
            raise ValueError("this chain forms x by recipes: build the kernel with RECIPES=1")
        min_k = mma_min_k(self.defines, self.cu)
        if define_value(self.defines, "MMA_ONLY", self.cu, default=0):
            bad = [ph.name for ph in bufs.chain.phases if ph.kind in ("gemv", "routed") and not (
                min_k is not None and ph.n % ph.rows == 0 and mma_tile(ph.rows, ph.rows, ph.k, min_k))]
            if bad:
                raise ValueError(f"built with MMA_ONLY, which sums tensor-core tiles only (rows a multiple of 16 "
                                 f"dividing n, k a multiple of 32 and at least MMA_MIN_K): not {', '.join(bad[:5])}")
        if bufs.chain.mlas:
            raise ValueError("this chain has MLA attention ('mla') phases, which chain.cu does not run yet: they are "
                             "emulated only (docs/megakernel.md, Next)")
        wide = too_wide(bufs.chain)
        if wide:
            raise ValueError(f"chain.cu keeps {', '.join(PHASE_INT16)} in 16 bits: {', '.join(wide[:3])} do not fit")
        unwritten = [bufs.chain.phases[q].name for q in bufs.chain.mixes if q not in bufs.chain.mix_writers()]
        if unwritten:
            raise ValueError(f"mix phases {', '.join(unwritten[:3])} have no GEMV that computes them ('attnres' x, "
                             f"Chain.gemv_after): chain.cu would never write their words")
        if bufs.chain.mixes and not define_value(self.defines, "MMA_ONLY", self.cu, default=0):
            raise ValueError("this chain has AttnRes x loads, which chain.cu runs only built with MMA_ONLY=1")
        if any(ph.kind == "kda" for ph in bufs.chain.phases) and self.consumers != 512:
            raise ValueError(f"this chain has KDA phases, which chain.cu runs on 512 consumer threads; the kernel "
                             f"has {self.consumers} (CONSUMER_WARPS)")
        if bufs.chain.caches and not define_value(self.defines, "MMA_ONLY", self.cu, default=0):
            raise ValueError("this chain has MLA attention (attn) phases, which chain.cu runs only built with "
                             "RECIPES=1 MMA_ONLY=1")
        rows = define_value(self.defines, "ATTN_ROWS_WARP", self.cu, default=0) * self.consumers // 32
        bad = [ph.name for ph in bufs.chain.phases if ph.kind == "attn" and ph.rows != rows]
        if bad:
            raise ValueError(f"attention phases {', '.join(bad[:3])} have tiles of {ATTN_ROWS} keys; this build's "
                             f"are {rows} (ATTN_ROWS_WARP x CONSUMER_WARPS)")
        heads = define_value(self.defines, "ATTN_HEADS", self.cu)
        bad = [(ph.name, ph.heads) for ph in bufs.chain.phases if ph.kind == "attn" and ph.heads != heads]
        if bad:
            raise ValueError(f"attention phases {', '.join(n for n, _ in bad[:3])} were built with {bad[0][1]} heads "
                             f"a tile; this build's tiles take {heads} (ATTN_HEADS)")
        if define_value(self.defines, "ATTN_MMA", self.cu, default=0):
            why = attn_mma_refusal(bufs.chain, define_value(self.defines, "ATTN_KCHUNKS", self.cu))
            if why:
                raise ValueError(why)
        self.smem = smem_bytes(self.nslot, self.slot_bytes, n, len(bufs.chain.xsegs))
        why = not_resident(self.per_sm, self.threads, self.regs, self.smem, self.static_smem)
        if why:
            raise ValueError(f"ring {self.nslot}x{self.slot_bytes} with {n} phases, {self.per_sm} block(s) an SM: "
                             f"{why}; the blocks would not all be resident, and would wait on each other")
        groups = max((row_groups(p, self.consumers, self.steps) for p in bufs.chain.phases
                      if p.kind not in ("topk", "attn")),                  # (attn tiles: `attn_tile`, no groups)
                     default=1)
        if groups > GROUPS:
            raise ValueError(f"a tile of this chain takes {groups} row groups with {self.consumers} consumer "
                             f"threads and STEPS = {self.steps}; chain.cu holds {GROUPS}")
        bufs.use_mma_layout(min_k)
        self.fn.max_dynamic_shared_size_bytes = self.smem
        self.bufs = bufs
        # (ARGMAX, COMMIT_LENGTHS: the blocks done, [n]; STEP_LOOP: the step's token word, [n + 1])
        self.counters = torch.zeros(n + 2, dtype=torch.int32, device="cuda")
        self.am_best = torch.zeros(1, dtype=torch.int64, device="cuda") if self.argmax else None
        if self.argmax:                             # (why this chain's launch cannot take the argmax; None: it can)
            last = bufs.chain.phases[-1]
            xop = bufs.chain.xsegs[last.xop].op if last.xop >= 0 else None
            self._argmax_refused = None if last.kind == "gemv" and xop == "attnres" else (
                f"ARGMAX: the launch takes the argmax of its last phase when it is a GEMV on an AttnRes x (the LM "
                f"head after the final mix); this chain ends with {last.name} ({last.kind}, x {xop})")
        self.err = torch.zeros(4, dtype=torch.int32, device="cuda")
        # (-DPHASE_TIMES: 4 per phase; -DBLOCK_TIMES: 4 per phase and block)
        self.t_done = torch.zeros(4 * n * (self.blocks if "BLOCK_TIMES" in self.defines else 1), dtype=torch.int64,
                                  device="cuda")
        self.t_start = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.trace = (torch.zeros(self.blocks * TRACE_UNITS * TRACE_FIELDS, dtype=torch.int64, device="cuda")
                      if "TRACE" in self.defines else None)
        self.tile_trace = (torch.zeros(self.blocks * TILE_TRACE_MAX * TILE_FIELDS, dtype=torch.int64, device="cuda")
                           if "TRACE_TILES" in self.defines else None)
        self.epoch = 0
        # (STEP_INPUTS: [the base, the largest epoch so far]; a base of 1 before any `start_sequence`)
        self.epoch_dev = (torch.tensor([1, 0], dtype=torch.int32, device="cuda") if self.step_inputs else
                          torch.zeros(1, dtype=torch.int32, device="cuda") if self.epoch_ptr else None)

    def start_sequence(self, length: int) -> None:
        """STEP_INPUTS: the next launch is a sequence's step at `length` rows; its epoch (the base + the length) is
        set above every epoch so far (a word of an earlier launch never passes for this one's). Reads the device."""
        high = int(self.epoch_dev[1])
        self.epoch_dev[0] = high + 1 - length

    def launch(self, mode: str, dump: bool = False) -> None:
        """One launch. dump: the x of each recipe goes to bufs.xdump (a check launch; see `Buffers.x_of`)."""
        import numpy as np
        b, u = self.bufs, np.uint64
        if self.step_inputs and mode == "serial":
            raise ValueError("STEP_INPUTS: mode serial counts tiles by epoch; its epochs (base + length) are not "
                             "consecutive across sequences; use stream")
        if self.step_loop and mode != "stream":
            raise ValueError(f"STEP_LOOP: the build runs stream mode only (a constant in chain.cu), not {mode}")
        self.epoch += 1
        b.kda_conv_out = (self.epoch & 1) ^ 1           # (chain.cu: the copy of each conv window this launch writes;
        if self.epoch_dev is not None and not self.step_inputs:  # STEP_INPUTS and graph replays: the host's count
            self.epoch_dev.add_(1)                               # stays behind)
        dump = dump and b.xdump is not None
        epoch = u(self.epoch_dev.data_ptr()) if self.epoch_ptr else np.uint32(self.epoch)
        args = (u(b.table.data_ptr()), np.int64(len(b.chain.phases)), u(b.x.data_ptr()),
                u(self.counters.data_ptr()), epoch, np.int32(MODES[mode]), u(self.err.data_ptr()),
                u(self.t_done.data_ptr()), u(self.t_start.data_ptr()),
                u(self.trace.data_ptr() if self.trace is not None else 0),
                u(self.tile_trace.data_ptr() if self.tile_trace is not None else 0),
                u(b.xsegs.data_ptr()), np.int64(len(b.chain.xsegs)), u(b.xdump.data_ptr() if dump else 0))
        if self.step_inputs:
            if self.step_args is None:
                raise ValueError("built with STEP_INPUTS: set step_args (embedding table, token ids, lengths) first")
            embed, ids, lengths = self.step_args
            if embed.dtype != torch.bfloat16 or embed.shape[1] != b.x.shape[0] or ids.dtype != torch.int64 \
                    or lengths.dtype != torch.int64:
                raise ValueError(f"STEP_INPUTS: an embedding table [V, {b.x.shape[0]}] bf16 and int64 ids and "
                                 f"lengths, got {embed.dtype} {tuple(embed.shape)}, {ids.dtype}, {lengths.dtype}")
            args = (args[0], args[1], u(embed.data_ptr()), *args[3:], u(ids.data_ptr()), u(lengths.data_ptr()),
                    np.int64(embed.shape[1]))
        if self.argmax:
            args = (*args, *self._argmax_launch_args())
        if self.commit_lengths:
            active = self.commit_active
            if active is not None and (active.dtype != torch.bool or active.device.type != "cuda"):
                raise ValueError(f"COMMIT_LENGTHS: active is bool on the GPU, got {active.dtype} on {active.device}")
            args = (*args, u(active.data_ptr() if active is not None else 0))
        if self.step_loop:
            args = (*args, np.int64(self._launch_steps()))
        elif self.nsteps != 1:
            raise ValueError(f"nsteps={self.nsteps}: this build runs one step a launch (build with STEP_LOOP=1)")
        b.dumped = dump
        if self.pdl:
            launch_pdl(self.fn, self.blocks, self.threads, self.smem, torch.cuda.current_stream().cuda_stream, args)
            return
        with self.stream():
            self.fn((self.blocks,), (self.threads,), args, shared_mem=self.smem)

    def _launch_steps(self) -> int:
        """STEP_LOOP: the steps this launch runs (`nsteps`), checked."""
        k = self.nsteps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"STEP_LOOP: nsteps is the steps a launch runs, a whole number >= 1, got {k!r}")
        if k > 1 and (self.argmax_args is None or self.commit_active is None):
            raise ValueError(f"STEP_LOOP: a launch of {k} steps feeds each step's greedy token to the next and "
                             "advances the lengths itself: set argmax_args and commit_active")
        return k

    def _argmax_launch_args(self) -> tuple:
        """ARGMAX's kernel arguments from `argmax_args` (nulls: no token), checked."""
        import numpy as np
        u = np.uint64
        if self.argmax_args is None:
            return u(0), u(0), u(0), np.int64(0), np.int64(1), u(self.am_best.data_ptr())
        ids, ring, active = self.argmax_args
        if self._argmax_refused:
            raise ValueError(self._argmax_refused)
        if ids.dtype != torch.int64 or ids.device.type != "cuda" or active.dtype != torch.bool:
            raise ValueError(f"ARGMAX: ids int64 on the GPU and active bool, got {ids.dtype} on {ids.device}, "
                             f"{active.dtype}")
        if ring is not None and (ring.dim() != 2 or ring.dtype != torch.int64 or ring.stride(1) != 1 or not (
                ring.device.type == "cuda" or ring.is_pinned())):
            raise ValueError(f"ARGMAX: the ring is [rows, slots] int64 with unit column stride, on the GPU or in "
                             f"pinned host memory (the launch writes it), got {tuple(ring.shape)} {ring.dtype} "
                             f"strides {ring.stride()} on {ring.device}{'' if ring.is_pinned() else ', not pinned'}")
        return (u(ids.data_ptr()), u(ring.data_ptr() if ring is not None else 0), u(active.data_ptr()),
                np.int64(ring.stride(0) if ring is not None else 0), np.int64(ring.shape[0] if ring is not None else 1),
                u(self.am_best.data_ptr()))

    def check(self) -> None:
        """Raise if a wait ran out in any launch so far (then reset counters, outputs and epoch, so that no word of
        an earlier launch carries a later launch's epoch)."""
        torch.cuda.synchronize()
        what, blk, p, t = self.err.tolist()
        if what:
            name = self.bufs.chain.phases[p].name if 0 <= p < len(self.bufs.chain.phases) else "?"
            where = self._steps_postmortem() if self.step_loop else ""
            self.counters.zero_()
            self.err.zero_()
            if self.am_best is not None:
                self.am_best.zero_()
            self.bufs.clear()
            self.epoch = 0
            if self.epoch_dev is not None:
                self.epoch_dev.zero_()
                if self.step_inputs:
                    self.epoch_dev[0] = 1
            if what == NAN_SCORE:
                raise RuntimeError(f"chain kernel stopped: router score of expert {t} is NaN (block {blk}, phase {p} "
                                   f"({name})){where}; the layers before it made a NaN (weights or state)")
            raise RuntimeError(f"chain kernel gave up waiting for {WAITS.get(what, what)}: block {blk}, "
                               f"phase {p} ({name}), tile {t}{where}")

    def _steps_postmortem(self) -> str:
        """STEP_LOOP, after a wait ran out: which of the last launch's steps it was in, from the words the steps
        leave (read before `check` resets them): the token word (the epoch of the step the last block released, the
        first step's epoch + the steps ended), the tail count (blocks that had ended the step after) and the epochs.
        `nsteps` is the host's last setting: a CUDA graph replays the one it captured, and a launch for an inactive
        sequence runs one step. (Written 12-06 for the hang hunt; not yet exercised on a GPU.)"""
        n = len(self.bufs.chain.phases)
        count, token = (int(v) for v in self.counters[n:n + 2].tolist())
        high = int(self.epoch_dev[1])
        first = high - self.nsteps + 1          # (block 0 leaves the launch's last step's epoch in epoch_dev[1])
        return (f"; in a launch of {self.nsteps} step(s) (epochs {first}..{high}): the token word says "
                f"{token - first} step(s) had ended (epoch {token}), {count} of {self.blocks} blocks had ended the "
                f"step after")

    def traced(self, mode: str) -> dict:
        """One launch with -DTRACE: per x load of the consumers (a (phase, slot); the first TRACE_UNITS per block),
        the time from the block's first barrier to x in shared memory (its input's wait included), and from there
        to the first tile's weights in the ring (us: median, p90, and per block the sum, averaged over blocks)."""
        self.trace.zero_()
        self.launch(mode)
        self.check()
        tr = self.trace.view(self.blocks, TRACE_UNITS, TRACE_FIELDS).cpu()
        ok = (tr[..., 0] > 0) & (tr[..., 1] > 0) & (tr[..., 2] > 0)
        # differences as integers: %globaltimer (~1.7e18 ns) as a double is exact only to 256 ns
        parts = {"x_load": (tr[..., 1] - tr[..., 0]).double(), "slot_wait": (tr[..., 2] - tr[..., 1]).double()}
        out = {"x_loads_per_block": ok.sum(1).double().mean().item()}
        for k, v in parts.items():
            x = v[ok] / 1e3
            out[k] = {"median_us": x.median().item(), "p90_us": x.quantile(0.9).item(),
                      "per_block_sum_us": (v.where(ok, torch.zeros(())).sum(1) / 1e3).mean().item()}
        return out

    def tiles_traced(self, mode: str) -> dict:
        """One launch with -DTRACE_TILES: what each block's ring did (`tile_pipeline`)."""
        self.tile_trace.zero_()
        self.launch(mode)
        self.check()
        tr = self.tile_trace.view(self.blocks, TILE_TRACE_MAX, TILE_FIELDS).cpu()
        return tile_pipeline(tr, block_tiles(self.bufs.chain, self.blocks, "PAIR_TILES=1" in self.defines))

    def timeline_us(self) -> list[float]:
        """When each phase of the last launch finished, us after block 0 started (a phase without tiles, a mix: when
        the phase before it did; its work is in its consumers' x loads)."""
        torch.cuda.synchronize()
        n = len(self.bufs.chain.phases)
        t = ((self.t_done.view(-1, 4 * n)[:, :n].amax(0) - self.t_start).double() / 1e3).tolist()
        for p, ph in enumerate(self.bufs.chain.phases):
            if ph.ntiles == 0:
                t[p] = t[p - 1] if p else 0.0
        return t

    def phase_times(self, mode: str) -> dict:
        """One launch of a -DPHASE_TIMES build: per phase, us after block 0 started, when the first block began it,
        had its x, had its first tile in the ring, and when the last block finished it. A -DBLOCK_TIMES build adds
        "blocks": the four per block ([blocks][phases] each; nan where the block has no tile of the phase)."""
        n = len(self.bufs.chain.phases)
        t_done = self.t_done.view(-1, 4, n)
        t_done[:, 0] = 0
        t_done[:, 1:] = -1                      # (as unsigned: the largest; the kernel takes minima)
        self.launch(mode)
        self.check()
        unset = (t_done == -1) | ((t_done == 0) & (torch.arange(4, device="cuda") == 0).view(1, 4, 1))
        t = ((t_done - self.t_start).double() / 1e3).masked_fill(unset, math.nan)
        first = t[:, 1:].nan_to_num(math.inf).amin(0).masked_fill(unset[:, 1:].all(0), math.nan)
        last = t[:, 0].nan_to_num(-math.inf).amax(0).masked_fill(unset[:, 0].all(0), math.nan)
        out = {"begin": first[0].tolist(), "x": first[1].tolist(), "tile": first[2].tolist(), "done": last.tolist()}
        if t.shape[0] > 1:
            out["blocks"] = {k: t[:, i].tolist() for i, k in enumerate(("done", "begin", "x", "tile"))}
        return out


def events_ms(fn, iters: int) -> list[float]:
    """ms of each of `iters` calls of fn(), CUDA events around each, after 5 warm-up calls (one sync at the end)."""
    for _ in range(5):
        fn()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in ts]


def run_chain(name: str, kern: ChainKernel, modes: list[str], rounds: int, iters: int) -> dict:
    chain = CHAINS[name](kern.slot_bytes)
    bufs = Buffers(chain)
    kern.bind(bufs)
    res = {"phases": len(chain.phases), "tiles": chain.ntiles, "bytes_read": chain.bytes_read, "check": {},
           "ms": {}, "round_medians_ms": {m: [] for m in modes}, "timeline_us": {}}
    for m in modes:                              # correctness first: outputs NaN, one launch, every phase checked
        bufs.clear()
        kern.launch(m)
        kern.check()
        if m == "nodeps" or {"SKIP_COMPUTE", "NOLOADX", "NOCOPY"} & set(kern.defines):
            res["check"][m] = "not checked: outputs wrong by design (no waits, or no sums)"
        else:
            e = res["check"][m] = bufs.errors()
            if Buffers.failed(e):
                raise RuntimeError(f"{name} {m}: outputs differ from the torch reference, not timing it: {e}")
        print(f"{name} {m}: {res['check'][m]}", flush=True)
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            t = events_ms(lambda: kern.launch(m), iters)
            kern.check()
            times[m] += t
            res["round_medians_ms"][m].append(statistics.median(t))
        print(f"{name} round: " + ", ".join(f"{m} {res['round_medians_ms'][m][-1]:.4f} ms" for m in modes), flush=True)
    for m in modes:
        res["ms"][m] = statistics.median(times[m])
        kern.launch(m)
        kern.check()
        res["timeline_us"][m] = kern.timeline_us()
        if kern.trace is not None:
            res.setdefault("trace", {})[m] = kern.traced(m)
            print(f"{name} {m} trace: {res['trace'][m]}", flush=True)
        if kern.tile_trace is not None:
            tp = res.setdefault("tile_pipeline", {})[m] = kern.tiles_traced(m)
            print(f"{name} {m} tiles: " + json.dumps({k: v for k, v in tp.items() if k != "landed_tbs"}), flush=True)
    res["phase_names"] = [p.name for p in chain.phases]
    res["phase_bytes"] = [p.bytes_read for p in chain.phases]
    return res


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save_png(fig, path: str) -> None:
    """Written to a temporary file, then renamed: no half-written plot."""
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def plot(result: dict, path: str) -> None:
    """Per chain: weight bytes of the finished phases against when they finished, per mode, beside the copy rate
    from the launch (the bytes floor)."""
    plt = _pyplot()
    charts = list(result["chains"].items())
    cols = min(3, len(charts))
    rows = -(-len(charts) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(charts):]:
        ax.axis("off")
    for ax, (name, r) in zip(axes.flat, charts):
        cum = [b / 1e6 for b in itertools.accumulate(r["phase_bytes"])]
        for m, t in r["timeline_us"].items():
            ax.plot([0.0] + t, [0.0] + cum, marker=".", ms=2, lw=1, label=f"{m}: {r['ms'][m]:.3f} ms")
        gbs = result["copy_gbs"]
        ax.plot([0, cum[-1] * 1e3 / gbs], [0, cum[-1]], "k--", lw=0.8, label=f"copy rate {gbs / 1e3:.2f} TB/s")
        ax.set_title(f"{name}: {r['phases']} phases, {r['bytes_read'] / 1e6:.0f} MB", fontsize=10)
        ax.set_xlabel("phase finished at (us after launch)")
        ax.set_ylabel("weight bytes of finished phases (MB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"One persistent launch per step, synthetic k3-small chain ({result['device']})", fontsize=11)
    fig.tight_layout()
    _save_png(fig, path)


def plot_tiles(result: dict, path: str) -> None:
    """Per traced (chain, mode) launch (-DTRACE_TILES): the weight bytes landing in the rings, all blocks together,
    per microsecond, against the copy rate."""
    plt = _pyplot()
    runs = [(f"{name} {m}", r["ms"][m], tp) for name, r in result["chains"].items()
            for m, tp in r.get("tile_pipeline", {}).items() if tp.get("landed_tbs")]
    if not runs:
        raise ValueError("no -DTRACE_TILES results to plot")
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.2 * len(runs)), squeeze=False, sharex=True)
    for ax, (label, ms, tp) in zip(axes[:, 0], runs):
        x = [i * tp["bin_us"] for i in range(len(tp["landed_tbs"]))]
        ax.plot(x, tp["landed_tbs"], lw=0.7)
        ax.axhline(result["copy_gbs"] / 1e3, color="k", ls="--", lw=0.8)
        stop = tp["per_block_us"]["stream_stopped"]
        ax.set_title(f"{label}: timed {ms:.3f} ms; a block's stream stopped {stop:.0f} us "
                     f"({tp['per_block_us']['stopped_ring_full']:.0f} with its ring full)", fontsize=9)
        ax.set_ylabel("TB/s landed")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(f"us after the traced launch's first copy (bins of {runs[0][2]['bin_us']:.0f} us; "
                           f"dashed: the copy rate)")
    fig.tight_layout()
    _save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chains", default="k3-small,skeleton")
    ap.add_argument("--modes", default="stream,serial,nodeps")
    ap.add_argument("--rings", default=DEFAULT_RING,
                    help="NSLOTxSLOT_BYTES[:DEFINE+DEFINE=V],... one kernel build each (defines: CONSUMER_WARPS=n, "
                         "STEPS=n; SKIP_COMPUTE: a diagnostic; see chain.cu)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--cu", type=Path, default=CU, help="another version of chain.cu (an A/B)")
    ap.add_argument("--out")
    ap.add_argument("--plot")
    ap.add_argument("--tile-plot", help="PNG of the landed bytes over time per -DTRACE_TILES launch")
    a = ap.parse_args()
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}: choose from {', '.join(MODES)}")
    for c in a.chains.split(","):
        if c not in CHAINS:
            raise SystemExit(f"unknown chain {c!r}: choose from {', '.join(CHAINS)}")
    from k3export.bench.ceilings import copy_bandwidth
    result = {"device": torch.cuda.get_device_name(0), "copy_gbs": copy_bandwidth() / 1e9, "chains": {}}
    print(f"copy {result['copy_gbs']:.0f} GB/s", flush=True)
    for ring in a.rings.split(","):
        size, _, defs = ring.partition(":")
        nslot, slot_bytes = (int(v) for v in size.split("x"))
        kern = ChainKernel(nslot, slot_bytes, defines=tuple(d for d in defs.split("+") if d), cu=a.cu)
        for c in a.chains.split(","):
            key = (c if ring == DEFAULT_RING else f"{c}@{ring}") + ("" if a.cu == CU else f"@{a.cu.name}")
            r = run_chain(c, kern, modes, a.rounds, a.iters)
            floor = r["bytes_read"] / (result["copy_gbs"] * 1e6)
            r["bytes_floor_ms"] = floor
            result["chains"][key] = r
            print(f"{key}: {r['phases']} phases, {r['tiles']} tiles, {r['bytes_read'] / 1e6:.0f} MB "
                  f"(floor {floor:.3f} ms): " + ", ".join(f"{m} {r['ms'][m]:.4f} ms" for m in modes), flush=True)
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, a.out)
    if a.plot:
        plot(result, a.plot)
    if a.tile_plot:
        plot_tiles(result, a.tile_plot)


if __name__ == "__main__":
    main()
