"""Choosing a token per row on the device: greedy decoding's argmax (`argmax_rows`) and reproducible sampling
(`draw`: temperature, top-k, top-p and the Gumbel-max draw), each a Triton program over parts of each row
(`row_parts`) of the logits as they lie (any strides: the megakernel's are a stride-2 view of its output words),
each able to post its tokens into a ring in host memory (`post`), where the runtime's pipelined `Generator` reads a
queued step's tokens.

A row's token is `argmax_j (z_j + G_j)` over the tokens top-k and top-p keep, with z = logits / temperature and G_j
Gumbel noise, which draws j with probability softmax(z)_j over the kept tokens (the Gumbel-max trick; temperature
0 is the plain argmax). The noise is a counter-based hash of (seed, counter, j), not a generator's stream: a row's
draw depends only on its logits, its `Sampling` and its counter (the runtime passes the sequence's length, the
prompt plus the tokens so far). So a request's tokens do not depend on what else shares the batch, on the batch
order, or on whether its steps were queued ahead (the pipelined `Generator`), and nothing reads back to the host:
a sampled step can be queued behind the one in flight as a greedy step is.

    u_j = (fmix32(J(j) ^ K(seed, counter)) >> 8 + 0.5) / 2^24        (J(j) = fmix32(j * 0x9E3779B1); fmix32:
    G_j = -log(-log(u_j))                                             MurmurHash3's 32-bit finalizer)

The hash is integer arithmetic, so its uniforms are the same bits on every device; the logs and the filter's
softmax are fp32 and may differ in their last bit across devices (a token can change only where two scores tie
to the last bit). `draw` runs it as one Triton program a row on a GPU (the same integer steps, under
TRITON_INTERPRET=1 on the CPU in the tests) and as torch ops elsewhere.

Filters (per row, `keep_threshold`): top-k keeps the k largest z, top-p then the smallest prefix of those, by
descending probability renormalised over them, whose mass before the last one is at most top_p; a token is kept
when its z is at least the last kept one's (ties at the edge are kept). The program takes the row sorted by torch
(or its top-k, when every filtered row sets top_k: `width`) and finds the threshold in one scan (`_threshold`); its
fp32 sums run in another order than torch's cumsum, so where the mass before a token lies within rounding of top_p
(a few 1e-7) the two may keep one token more or less (the draw then differs only if it picks that token).

The argmax (`argmax_rows`): each lane keeps the first index of its largest value, then the row's first index of the
largest is taken across the lanes, as `torch.argmax` picks it (NaN counts as +inf, where torch counts it as the
largest: they differ only in a row with both); a row split over programs takes the first index of the parts'
largest maximum (`finish_row`). H200 12-04: 4.0 us a token over the megakernel's 32768 strided logits in 16 parts
(6.0-6.5 in one program a row), where torch's argmax took 12.2.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                   # (the CPU wheel's machines without triton: torch ops)
    triton = None

M32 = 0xFFFFFFFF
GOLDEN, SEED_MUL, COUNTER_MUL = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D     # (the Triton program's literals too)
BLOCK = 2048             # values a round of the argmax and draw programs (a part of a row: `row_parts`)
UNPOSTED = -1            # a ring entry that holds no step's token (a post whose fail word is set; the runtime clears
                         # a step's rows to it before queueing the step: `Engine.unposted`)


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """a * b mod 2^32 for int64 a in [0, 2^32), without int64 overflow (16-bit halves of b)."""
    lo = a * (b & 0xFFFF)
    hi = ((a * (b >> 16)) & 0xFFFF) << 16
    return (lo + hi) & M32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer over int64 values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_keys(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """K(seed, counter) per row `[B]` int64 in [0, 2^32)."""
    s, c = seed.to(torch.int64) & M32, counter.to(torch.int64) & M32
    return fmix32((_mul32(s, SEED_MUL) + _mul32(fmix32(c), COUNTER_MUL)) & M32)


def uniforms(seed: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """u `[B, n]` fp32 in (0, 1): the torch form of the hash (the reference of the Triton program's)."""
    j = torch.arange(n, dtype=torch.int64, device=seed.device)
    h = fmix32(fmix32(_mul32(j, GOLDEN))[None, :] ^ row_keys(seed, counter)[:, None])
    return ((h >> 8).to(torch.float32) + 0.5) * 2.0 ** -24


def keep_threshold(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest z a row keeps `[B]` fp32 under its top-k (0: off) and top-p (1: off), z `[B, V]` fp32 (-inf
    where both are off)."""
    B, V = z.shape
    sz = z.sort(-1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V)).to(torch.int64)
    rank = torch.arange(V, device=z.device)[None, :]
    p = torch.softmax(sz.masked_fill(rank >= k[:, None], float("-inf")), -1)
    before = p.cumsum(-1) - p                       # mass of the more likely tokens
    tp = top_p.to(torch.float32)[:, None]
    n_keep = (((before <= tp) | (tp >= 1)) & (rank < k[:, None])).sum(-1).clamp(min=1)
    thr = sz.gather(1, (n_keep - 1)[:, None]).squeeze(1)
    return torch.where((top_k == 0) & (tp[:, 0] >= 1), torch.full_like(thr, float("-inf")), thr)


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents

    @triton.jit
    def load_row(base, o, n, col_stride):
        """A block of a row's values at offsets o as fp32, NaN as +inf (-inf past n): what an argmax compares."""
        v = tl.load(base + o.to(tl.int64) * col_stride, mask=o < n, other=float("-inf")).to(tl.float32)
        return tl.where(v != v, float("inf"), v)

    @triton.jit
    def keep_max(s, o, best, idx):
        """Each lane's largest value so far and its first index (strict: a later equal value does not take it)."""
        take = s > best
        return tl.where(take, s, best), tl.where(take, o, idx)

    @triton.jit
    def finish_row(best, idx, n, row, part, parts, part_max, part_idx, count, out_ptr, post_ptr, len_ptr, fail_ptr,
                   post_stride, post_rows, POST: tl.constexpr, PARTS: tl.constexpr):
        """A program's part of a row done: the first index of its largest value across the lanes (as torch.argmax
        picks it) is the row's token when the row is one part (PARTS 1); else it goes to the row's scratch, and the
        part that finishes last (a counter, acq_rel at GPU scope, reset by that part) takes the first index of the
        parts' largest maximum. Then the token into out (and the ring, with POST)."""
        m = tl.max(best, axis=0)
        i = tl.min(tl.where(best == m, idx, n), axis=0)
        if PARTS == 1:
            tl.store(out_ptr + row, i.to(tl.int64))
            post_token(post_ptr, len_ptr, fail_ptr, row, post_stride, post_rows, i.to(tl.int64), POST)
        else:
            tl.store(part_max + row * PARTS + part, m)
            tl.store(part_idx + row * PARTS + part, i)
            tl.debug_barrier()                              # (the stores before this program's count)
            done = tl.atomic_add(count + row, 1)
            if done == parts - 1:
                tl.debug_barrier()
                k = tl.arange(0, PARTS)
                pm = tl.load(part_max + row * PARTS + k, mask=k < parts, other=float("-inf"), volatile=True)
                pi = tl.load(part_idx + row * PARTS + k, mask=k < parts, other=n, volatile=True)
                tok = tl.min(tl.where(pm == tl.max(pm, axis=0), pi, n), axis=0).to(tl.int64)
                tl.store(out_ptr + row, tok)
                post_token(post_ptr, len_ptr, fail_ptr, row, post_stride, post_rows, tok, POST)
                tl.store(count + row, 0)

    @triton.jit
    def post_token(post_ptr, len_ptr, fail_ptr, row, post_stride, post_rows, tok, POST: tl.constexpr):
        """With POST, a row's token also into its column of the ring, at the row's length modulo the ring's rows;
        POST 2: UNPOSTED instead when the word at fail_ptr is set (the program before this one failed: the logits
        are not a step's)."""
        if POST:
            at = tl.load(len_ptr + row).to(tl.int64) % post_rows
            if POST == 2:
                tok = tl.where(tl.load(fail_ptr) != 0, -1, tok)         # (-1: UNPOSTED)
            tl.store(post_ptr + at * post_stride + row, tok)

    @triton.jit
    def _fmix32(h):
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _sorted_z(base, r, kk, col, t):
        return tl.math.div_rn(tl.load(base + r.to(tl.int64) * col, mask=r < kk, other=float("-inf")).to(tl.float32), t)

    @triton.jit
    def _threshold(sorted_ptr, ns, n, row, sorted_stride, sorted_col, t, topk_ptr, topp_ptr, BLOCK: tl.constexpr):
        """A row's keep threshold (`keep_threshold`) from its values sorted in descending order (the first ns of
        them): the top-k's normaliser in one pass, then the top-p's prefix count by a running scan, stopping at the
        first block whose preceding mass exceeds top_p (the count can only grow within the block that crosses)."""
        offs = tl.arange(0, BLOCK)
        base = sorted_ptr + row.to(tl.int64) * sorted_stride
        top_k = tl.load(topk_ptr + row).to(tl.int32)
        tp = tl.load(topp_ptr + row).to(tl.float32)
        kk = tl.minimum(tl.where((top_k > 0) & (top_k < n), top_k, n), ns)
        m = tl.math.div_rn(tl.load(base).to(tl.float32), t)
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, kk, BLOCK):
            r = start + offs
            z = _sorted_z(base, r, kk, sorted_col, t)
            total += tl.exp(z - m)
        norm = tl.sum(total, axis=0)
        keep = kk
        if tp < 1.0:
            carry = norm * 0.0
            count = kk * 0
            for start in range(0, kk, BLOCK):
                if carry <= tp:
                    r = start + offs
                    z = _sorted_z(base, r, kk, sorted_col, t)
                    p = tl.exp(z - m) / norm
                    c = carry + tl.cumsum(p, axis=0)
                    count += tl.sum(((c - p <= tp) & (r < kk)).to(tl.int32), axis=0)
                    carry = tl.max(tl.where(r < kk, c, 0.0), axis=0)
            keep = tl.maximum(count, 1)
        thr = tl.math.div_rn(tl.load(base + (keep - 1).to(tl.int64) * sorted_col).to(tl.float32), t)
        return tl.where((top_k == 0) & (tp >= 1.0), float("-inf"), thr)

    @triton.jit
    def _draw_kernel(x_ptr, out_ptr, temp_ptr, sorted_ptr, topk_ptr, topp_ptr, seed_ptr, counter_ptr, n, ns,
                     row_stride, col_stride, sorted_stride, sorted_col, post_ptr, post_len_ptr, fail_ptr, post_stride,
                     post_rows,
                     span, parts, part_max, part_idx, count,
                     FILTERED: tl.constexpr, POST: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr):
        row, part = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        temp = tl.load(temp_ptr + row).to(tl.float32)
        seed = tl.load(seed_ptr + row).to(tl.uint32)                # (the low 32 bits, as `row_keys` takes them)
        counter = tl.load(counter_ptr + row).to(tl.uint32)
        key = _fmix32(seed * 0x85EBCA77 + _fmix32(counter) * 0xC2B2AE3D)
        greedy = temp == 0.0
        t = tl.where(greedy, 1.0, temp)
        if FILTERED:
            thr = _threshold(sorted_ptr, ns, n, row, sorted_stride, sorted_col, t, topk_ptr, topp_ptr, BLOCK)
        else:
            thr = float("-inf")
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        idx = tl.zeros([BLOCK], tl.int32)
        base = x_ptr + row.to(tl.int64) * row_stride
        for start in range(part * span, tl.minimum(n, part * span + span), BLOCK):
            o = start + offs
            v = load_row(base, o, n, col_stride)
            z = tl.math.div_rn(v, t)                # (IEEE division, as torch's)
            h = _fmix32(_fmix32(o.to(tl.uint32) * 0x9E3779B1) ^ key)
            u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08
            g = -tl.log(-tl.log(u))
            s = tl.where(greedy, v, tl.where(z >= thr, z + g, float("-inf")))
            s = tl.where(o < n, s, float("-inf"))
            best, idx = keep_max(s, o, best, idx)
        finish_row(best, idx, n, row, part, parts, part_max, part_idx, count, out_ptr, post_ptr, post_len_ptr,
                   fail_ptr, post_stride, post_rows, POST, PARTS)

    @triton.jit
    def _threshold_kernel(sorted_ptr, thr_ptr, temp_ptr, topk_ptr, topp_ptr, n, ns, sorted_stride, sorted_col,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0)
        temp = tl.load(temp_ptr + row).to(tl.float32)
        t = tl.where(temp == 0.0, 1.0, temp)
        tl.store(thr_ptr + row, _threshold(sorted_ptr, ns, n, row, sorted_stride, sorted_col, t, topk_ptr, topp_ptr,
                                           BLOCK))

    @triton.jit
    def _argmax_kernel(x_ptr, out_ptr, post_ptr, len_ptr, fail_ptr, n, row_stride, col_stride, post_stride, post_rows,
                       span, parts, part_max, part_idx, count, POST: tl.constexpr, PARTS: tl.constexpr,
                       BLOCK: tl.constexpr, EARLY: tl.constexpr = False):
        if EARLY:                           # (`launch_argmax(early=True)`: the next PDL launch may begin now)
            gdc_launch_dependents()
        row, part = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        idx = tl.zeros([BLOCK], tl.int32)
        base = x_ptr + row.to(tl.int64) * row_stride
        for start in range(part * span, tl.minimum(n, part * span + span), BLOCK):
            o = start + offs
            best, idx = keep_max(load_row(base, o, n, col_stride), o, best, idx)
        finish_row(best, idx, n, row, part, parts, part_max, part_idx, count, out_ptr, post_ptr, len_ptr, fail_ptr,
                   post_stride, post_rows, POST, PARTS)


PART = BLOCK             # values a part of a row when a row is split over programs (`row_parts`)
MAX_PROGRAMS = 264       # programs a launch aims at when it splits rows (two per H200 SM)
_scratch: dict[tuple, tuple] = {}


def row_parts(B: int, n: int, block: int, parts: int | None = None) -> tuple[int, int, int]:
    """(span, parts, PARTS) for rows of n values over B rows: each row split into `parts` programs of `span` values
    (a multiple of block), at most MAX_PROGRAMS in all (B = 1 at 32768 logits: 16 programs of 2048, where one
    program a row took 6.5 us for the argmax and 27 for the draw on the H200, 12-04); PARTS is the power of two
    the combine reads. parts: force a count (the tests)."""
    blocks = -(-n // block)
    if parts is None:
        parts = max(1, min(-(-n // max(PART, block)), MAX_PROGRAMS // max(B, 1)))
    parts = max(1, min(parts, blocks))
    span = -(-blocks // parts) * block
    parts = -(-n // span)
    return span, parts, 1 if parts == 1 else 1 << (parts - 1).bit_length()


def part_scratch(device, B: int, PARTS: int) -> tuple[torch.Tensor, ...]:
    """Each row's parts' maxima, their indices and the row's count of finished parts (zero between launches: the
    last part resets it), kept per (device, B, PARTS) so a captured launch reads the same memory at every replay;
    launches sharing them must not overlap (one stream). Made inside a capture, they are the graph's own."""
    key = (str(device), B, PARTS)
    if key in _scratch:
        return _scratch[key]
    made = (torch.empty(B, PARTS, dtype=torch.float32, device=device),
            torch.empty(B, PARTS, dtype=torch.int32, device=device), torch.zeros(B, dtype=torch.int32, device=device))
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _scratch[key] = made
    return made


def post_args(post: tuple | None, like: torch.Tensor) -> tuple:
    """(ring, lengths, fail, ring row stride, ring rows, POST) for a program's POST arguments (placeholders
    without a post). post: (ring, lengths) or (ring, lengths, fail), fail a device word that, when set, makes the
    program post UNPOSTED instead of its tokens (POST 2)."""
    if post is None:
        return like, like, like, 0, 1, 0
    if len(post) not in (2, 3):
        raise ValueError(f"post: (ring, lengths) or (ring, lengths, fail), got {len(post)} items")
    ring, lengths = post[:2]
    if ring.dim() != 2 or ring.dtype != torch.int64 or ring.stride(1) != 1:
        raise ValueError(f"post: the ring is [rows, slots] int64 with unit column stride, got {tuple(ring.shape)} "
                         f"{ring.dtype} strides {ring.stride()}")
    fail = post[2] if len(post) == 3 else None
    if fail is not None and (fail.dtype != torch.int32 or fail.numel() < 1 or fail.device != like.device):
        raise ValueError(f"post: fail is an int32 word on the program's device ({like.device}), got {fail.dtype} "
                         f"{tuple(fail.shape)} on {fail.device}")
    return ring, lengths, like if fail is None else fail, ring.stride(0), ring.shape[0], 1 if fail is None else 2


def post_reference(post: tuple, tokens: torch.Tensor) -> None:
    """What the programs' POST does, as torch ops: row b's token into ring[lengths[b] % rows, b] (UNPOSTED when
    the post's fail word is set)."""
    ring, lengths = post[:2]
    tokens = tokens.to(ring.device)
    if len(post) == 3:
        tokens = torch.where(post[2].reshape(-1)[:1].to(ring.device) != 0, UNPOSTED, tokens)
    rows = torch.arange(tokens.numel(), device=ring.device)
    ring[lengths.to(ring.device) % ring.shape[0], rows] = tokens


def _prepare(logits, temperature, top_k, top_p, filtered):
    """Per-row fp32 temperature and keep threshold (-inf: no filter)."""
    B = logits.shape[0]
    temp = temperature.to(device=logits.device, dtype=torch.float32).reshape(B)
    if filtered:
        z = logits.float() / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
        thr = keep_threshold(z, top_k.to(logits.device).reshape(B), top_p.to(logits.device).reshape(B))
    else:
        thr = torch.full((B,), float("-inf"), dtype=torch.float32, device=logits.device)
    return temp, thr


def draw_reference(logits, temperature, top_k, top_p, seed, counter, filtered: bool = True) -> torch.Tensor:
    """`draw` as torch ops (every device): token ids `[B]` int64."""
    temp, thr = _prepare(logits, temperature, top_k, top_p, filtered)
    v = logits.float()
    v = torch.where(v != v, torch.full_like(v, float("inf")), v)
    z = v / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
    g = -torch.log(-torch.log(uniforms(seed.to(logits.device), counter.to(logits.device), v.shape[1])))
    s = torch.where(z >= thr[:, None], z + g, torch.full_like(z, float("-inf")))
    return torch.where(temp == 0, v.argmax(-1), s.argmax(-1))


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         seed: torch.Tensor, counter: torch.Tensor, out: torch.Tensor | None = None,
         filtered: bool = True, width: int | None = None, post: tuple | None = None) -> torch.Tensor:
    """Each row's token `[B]` int64 (into out when given) from logits `[B, V]` (any strides) and per-row tensors
    `[B]`: temperature (0: greedy), top_k (0: off), top_p (1: off), seed and counter (see the module docstring).
    filtered=False skips the top-k / top-p pass (every row's are off: no sort). width: how many of each row's
    largest values the filters can need (`sort_width`: the largest top_k when every filtered row sets one, so a
    top-k replaces the sort); None: the whole row. post (ring `[R, >= B]` int64, e.g. pinned host memory the device
    can write, and lengths `[B]`, e.g. the counters): each row's token also goes to ring[lengths[b] % R, b], so a
    host can read a queued step's tokens there without a copy of its own (the runtime's `Engine.posted`). No host
    sync: queueable behind a step in flight, and capturable."""
    if logits.dim() != 2:
        raise ValueError(f"draw: logits [B, V], got shape {tuple(logits.shape)}")
    B = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed),
                    ("counter", counter)):
        if t.numel() != B:
            raise ValueError(f"draw: {name} needs one value per row ({B}), got shape {tuple(t.shape)}")
    if width is not None and not 0 < width:
        raise ValueError(f"draw: width must be a positive count of values, got {width}")
    if logits.device.type != "cuda" or triton is None:
        r = draw_reference(logits, temperature, top_k, top_p, seed, counter, filtered)
        if post is not None:
            post_reference(post, r)
        return r if out is None else out.copy_(r)
    return launch(logits, temperature, top_k, top_p, seed, counter, out, filtered, width=width, post=post)


def sort_width(top_k: list[int], top_p: list[float], vocab: int) -> int | None:
    """`draw`'s width for these rows' settings (greedy rows excluded by the caller): the largest top_k when every
    row with a filter sets one (a row with top-p alone needs its whole row sorted: None)."""
    if any(k == 0 and p < 1.0 for k, p in zip(top_k, top_p)):
        return None
    return min(max(top_k, default=1) or 1, vocab)


def launch(logits, temperature, top_k, top_p, seed, counter, out=None, filtered: bool = True,
           block: int = BLOCK, width: int | None = None, post: tuple | None = None,
           parts: int | None = None) -> torch.Tensor:
    """The Triton program itself on the logits' device (the tests run it on the CPU under TRITON_INTERPRET=1). The
    row keys are hashed in the program, so without the filter a draw is this one launch (the engine's per-slot
    buffers need no conversion: fp32 temperature, integer seed and counter). With it, the rows' values are sorted
    first (torch's sort, or its top-k for a width below the vocabulary), and the program finds each row's threshold
    from them (`_threshold`) before it draws."""
    dev, (B, V) = logits.device, logits.shape
    temp = temperature.reshape(B)
    if temp.dtype != torch.float32 or temp.device != dev:
        temp = temp.to(device=dev, dtype=torch.float32)
    seed, counter = seed.reshape(B).to(dev), counter.reshape(B).to(dev)
    top_k, top_p = top_k.reshape(B).to(dev), top_p.reshape(B).to(dev)
    if filtered:
        ns = V if width is None else min(width, V)
        ordered = logits.sort(-1, descending=True).values if ns == V else logits.topk(ns, -1).values
    else:
        ns, ordered = 0, logits
    res = out if out is not None and out.dtype == torch.int64 and out.is_contiguous() else \
        torch.empty(B, dtype=torch.int64, device=dev)
    ring, post_lengths, fail, post_stride, post_rows, mode = post_args(post, res)
    span, n_parts, PARTS = row_parts(B, V, block, parts)
    _draw_kernel[(B, n_parts)](logits, res, temp, ordered, top_k, top_p, seed, counter, V, ns, *logits.stride(),
                               *ordered.stride(), ring, post_lengths, fail, post_stride, post_rows, span, n_parts,
                               *part_scratch(dev, B, PARTS), FILTERED=filtered, POST=mode, PARTS=PARTS,
                               BLOCK=block, num_warps=8 if n_parts == 1 else 4)
    return res if out is None or res is out else out.copy_(res)


def program_thresholds(logits, temperature, top_k, top_p, width: int | None = None,
                       block: int = BLOCK) -> torch.Tensor:
    """The keep thresholds `[B]` fp32 the Triton program draws with (its `_threshold`, as `launch` sorts for it):
    for the tests, against `keep_threshold`."""
    B, V = logits.shape
    ns = V if width is None else min(width, V)
    ordered = logits.sort(-1, descending=True).values if ns == V else logits.topk(ns, -1).values
    thr = torch.empty(B, dtype=torch.float32, device=logits.device)
    _threshold_kernel[(B,)](ordered, thr, temperature.reshape(B).float(), top_k.reshape(B), top_p.reshape(B).float(),
                            V, ns, *ordered.stride(), BLOCK=block, num_warps=8)
    return thr


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None, post: tuple | None = None,
                early: bool = False) -> torch.Tensor:
    """x `[B, V]` (any strides, fp32 / bf16 / fp16) -> the index of each row's largest value `[B]` int64 (into out
    when given); capturable in a CUDA graph. post: also write each row's index into a ring (`k3export.sampling.draw`'s
    post: the program itself does, on a GPU). early: on a GPU of compute capability >= 9, the program lets the
    stream's next kernel, when that is a programmatic dependent launch, begin first thing
    (`griddepcontrol.launch_dependents`): for a next kernel that waits before it reads anything (the megakernel's
    PDL build), not for one that reads this program's output before its wait."""
    if x.dim() != 2:
        raise ValueError(f"argmax_rows: logits [B, V], got shape {tuple(x.shape)}")
    if x.device.type != "cuda" or triton is None:
        r = x.argmax(-1)
        if post is not None:
            post_reference(post, r)
        return r if out is None else out.copy_(r)
    if early:
        from k3export.plugins.launch import pdl_capable
        early = pdl_capable(x.device)
    return launch_argmax(x, out, post=post, early=early)


def launch_argmax(x: torch.Tensor, out: torch.Tensor | None = None, block: int = BLOCK,
                  post: tuple | None = None, parts: int | None = None, early: bool = False) -> torch.Tensor:
    """The Triton program itself on x's device (the tests run it on the CPU under TRITON_INTERPRET=1). early: see
    `argmax_rows` (sm_90 and later only)."""
    res = out if out is not None and out.dtype == torch.int64 and out.is_contiguous() else \
        torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    ring, lengths, fail, stride, rows, mode = post_args(post, res)
    B, n = x.shape
    span, n_parts, PARTS = row_parts(B, n, block, parts)
    _argmax_kernel[(B, n_parts)](x, res, ring, lengths, fail, n, x.stride(0), x.stride(1), stride, rows, span,
                                 n_parts, *part_scratch(x.device, B, PARTS), POST=mode, PARTS=PARTS, BLOCK=block,
                                 EARLY=bool(early), num_warps=8 if n_parts == 1 else 4)
    return res if out is None or res is out else out.copy_(res)
