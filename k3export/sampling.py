"""Sampling a token per row on the device, reproducibly: temperature, top-k, top-p and the Gumbel-max draw.

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
when its z is at least the last kept one's (ties at the edge are kept).
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
BLOCK = 4096             # values a round of the Triton program (8 rounds for k3-small's 32768)


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
    """The smallest z a row keeps `[B]` fp32 under its top-k (0: off) and top-p (1: off), z `[B, V]` fp32."""
    B, V = z.shape
    sz = z.sort(-1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V)).to(torch.int64)
    rank = torch.arange(V, device=z.device)[None, :]
    p = torch.softmax(sz.masked_fill(rank >= k[:, None], float("-inf")), -1)
    before = p.cumsum(-1) - p                       # mass of the more likely tokens
    tp = top_p.to(torch.float32)[:, None]
    n_keep = (((before <= tp) | (tp >= 1)) & (rank < k[:, None])).sum(-1).clamp(min=1)
    return sz.gather(1, (n_keep - 1)[:, None]).squeeze(1)


if triton is not None:
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
    def first_of_max(best, idx, n):
        """The row's first index of its largest value across the lanes (as torch.argmax picks it)."""
        m = tl.max(best, axis=0)
        return tl.min(tl.where(best == m, idx, n), axis=0).to(tl.int64)

    @triton.jit
    def _fmix32(h):
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _draw_kernel(x_ptr, out_ptr, temp_ptr, thr_ptr, seed_ptr, counter_ptr, n, row_stride, col_stride,
                     FILTERED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        temp = tl.load(temp_ptr + row).to(tl.float32)
        thr = tl.load(thr_ptr + row) if FILTERED else float("-inf")
        seed = tl.load(seed_ptr + row).to(tl.uint32)                # (the low 32 bits, as `row_keys` takes them)
        counter = tl.load(counter_ptr + row).to(tl.uint32)
        key = _fmix32(seed * 0x85EBCA77 + _fmix32(counter) * 0xC2B2AE3D)
        greedy = temp == 0.0
        t = tl.where(greedy, 1.0, temp)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        idx = tl.zeros([BLOCK], tl.int32)
        base = x_ptr + row.to(tl.int64) * row_stride
        for start in range(0, n, BLOCK):
            o = start + offs
            v = load_row(base, o, n, col_stride)
            z = tl.math.div_rn(v, t)                # (IEEE division, as torch's)
            h = _fmix32(_fmix32(o.to(tl.uint32) * 0x9E3779B1) ^ key)
            u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08
            g = -tl.log(-tl.log(u))
            s = tl.where(greedy, v, tl.where(z >= thr, z + g, float("-inf")))
            s = tl.where(o < n, s, float("-inf"))
            best, idx = keep_max(s, o, best, idx)
        tl.store(out_ptr + row, first_of_max(best, idx, n))


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
         filtered: bool = True) -> torch.Tensor:
    """Each row's token `[B]` int64 (into out when given) from logits `[B, V]` (any strides) and per-row tensors
    `[B]`: temperature (0: greedy), top_k (0: off), top_p (1: off), seed and counter (see the module docstring).
    filtered=False skips the top-k / top-p pass (every row's are off: no sort). No host sync: queueable behind a
    step in flight, and capturable."""
    if logits.dim() != 2:
        raise ValueError(f"draw: logits [B, V], got shape {tuple(logits.shape)}")
    B = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed),
                    ("counter", counter)):
        if t.numel() != B:
            raise ValueError(f"draw: {name} needs one value per row ({B}), got shape {tuple(t.shape)}")
    if logits.device.type != "cuda" or triton is None:
        r = draw_reference(logits, temperature, top_k, top_p, seed, counter, filtered)
        return r if out is None else out.copy_(r)
    return launch(logits, temperature, top_k, top_p, seed, counter, out, filtered)


def launch(logits, temperature, top_k, top_p, seed, counter, out=None, filtered: bool = True,
           block: int = BLOCK) -> torch.Tensor:
    """The Triton program itself on the logits' device (the tests run it on the CPU under TRITON_INTERPRET=1). The
    row keys are hashed in the program, so without the filter a draw is this one launch (the engine's per-slot
    buffers need no conversion: fp32 temperature, integer seed and counter)."""
    dev, B = logits.device, logits.shape[0]
    temp = temperature.reshape(B)
    if temp.dtype != torch.float32 or temp.device != dev:
        temp = temp.to(device=dev, dtype=torch.float32)
    thr = _prepare(logits, temp, top_k, top_p, True)[1] if filtered else temp
    seed, counter = seed.reshape(B).to(dev), counter.reshape(B).to(dev)
    res = out if out is not None and out.dtype == torch.int64 and out.is_contiguous() else \
        torch.empty(B, dtype=torch.int64, device=dev)
    _draw_kernel[(B,)](logits, res, temp, thr, seed, counter, logits.shape[1], logits.stride(0), logits.stride(1),
                       FILTERED=filtered, BLOCK=block, num_warps=8)
    return res if out is None or res is out else out.copy_(res)
