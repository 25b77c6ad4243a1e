"""A background HBM reader for `scripts/ab_decode.py --background`: `n` persistent programs on a side stream stream
a large buffer (evict-first loads) until told to stop, so a decode step timed meanwhile shares the
memory system with a known, measured read rate. GPU only.

The question it answers: could the decode step's bytes move *while* its chain of dependent kernels runs (the
premise of a persistent "megakernel" that streams the next phases' weights during the current phase's waits),
or does a memory system kept busy slow the chain itself down? Time the narrow-width skeleton (the chain without
its bytes) with the reader at several rates: k3-small's 2x target needs its 1458 MB per step to move at ~2.1 TB/s
beside a chain that still fits in 0.68 ms.

    with Background(programs=32) as bg:
        ...time the step...
    bg.bandwidth    # bytes/s the reader achieved while it ran
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096        # bf16 elements per load: 8 KB, one 16-byte vector per thread at 16 warps
UNROLL = 16         # loads in flight per program between two looks at the stop flag (128 KB)


@triton.jit
def _reader_kernel(buf, n_chunks, flag, out, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Program i reads chunks i, i + n, i + 2n, ... (UNROLL at a time, wrapping around the buffer) until flag != 0;
    stores its fp32 sum (so the loads are not dropped) and its number of rounds."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    c = pid
    rounds = 0
    while tl.load(flag, volatile=True) == 0:
        for u in tl.static_range(UNROLL):
            chunk = ((c + u * nprog) % n_chunks).to(tl.int64)
            acc += tl.load(buf + chunk * BLOCK + offs, eviction_policy="evict_first").to(
                tl.float32)
        c = (c + UNROLL * nprog) % n_chunks
        rounds += 1
    tl.store(out + 2 * pid, tl.sum(acc, 0))
    tl.store(out + 2 * pid + 1, rounds.to(tl.float32))


class Background:
    """`programs` reader programs on their own stream while the block runs (0: none); `bandwidth` afterwards (of
    the last run: the block may be entered again). `buf` (bf16, a multiple of BLOCK elements): the buffer to read,
    e.g. one shared by readers of several sizes; by default its own of `gib` GiB."""

    def __init__(self, programs: int, gib: float = 4.0, num_warps: int = 16, buf: torch.Tensor | None = None):
        self.programs, self.num_warps = programs, num_warps
        if programs and buf is None:
            buf = new_buffer(gib)
        self.buf = buf if programs else None
        self.flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.out = torch.zeros(2 * max(programs, 1), dtype=torch.float32, device="cuda")
        self.stream = torch.cuda.Stream()
        self.stop_stream = torch.cuda.Stream()
        self.bandwidth = 0.0
        self.seconds = 0.0
        if programs:                       # compile now, outside the timed window (the flag set: it exits at once)
            self.flag.fill_(1)
            self._launch()
            torch.cuda.synchronize()

    def _launch(self):
        _reader_kernel[(self.programs,)](self.buf, self.buf.numel() // BLOCK, self.flag, self.out, BLOCK=BLOCK,
                                         UNROLL=UNROLL, num_warps=self.num_warps)

    def __enter__(self):
        if not self.programs:
            return self
        torch.cuda.synchronize()
        self.flag.zero_()
        torch.cuda.synchronize()
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.start.record()
            self._launch()
            self.end.record()
        return self

    def __exit__(self, *exc):
        if not self.programs:
            return False
        with torch.cuda.stream(self.stop_stream):
            self.flag.fill_(1)
        self.end.synchronize()
        torch.cuda.synchronize()
        self.seconds = self.start.elapsed_time(self.end) / 1e3
        rounds = float(self.out[1::2].sum())
        self.bandwidth = rounds * UNROLL * BLOCK * 2 / self.seconds
        return False


def new_buffer(gib: float = 4.0) -> torch.Tensor:
    """A bf16 buffer of ~`gib` GiB for the readers, a whole number of BLOCK-element chunks."""
    return torch.ones(int(gib * 2**30) // 2 // BLOCK * BLOCK, dtype=torch.bfloat16, device="cuda")


def alone(bg: Background, seconds: float = 0.05) -> float:
    """bg's rate with nothing else running (bytes/s)."""
    import time
    with bg:
        time.sleep(seconds)
    return bg.bandwidth
