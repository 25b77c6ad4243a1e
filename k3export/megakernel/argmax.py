"""Greedy decoding's argmax over a strided row of logits, in one Triton program a row.

The `megakernel` backend's logits are the fp32 halves of the launch's 8-byte output words (a stride-2 view), and
torch's argmax over them took 11.8 us of each generated token on the H200 (12-03 14:05, `profile_decode.py
--generate`: one `reduce_kernel` over 32768 values). `argmax_rows` reads the row as it lies, `BLOCK` values a round:
each lane keeps the first index of its largest value, then the row's first index of the largest is taken across the
lanes, as `torch.argmax` picks it (NaN counts as +inf, where torch counts it as the largest: they differ only in a
row with both). On any other device, or without Triton, it is `torch.argmax`.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                   # (the CPU wheel's machines without triton: torch.argmax)
    triton = None
else:
    from k3export.sampling import first_of_max, keep_max, load_row

BLOCK = 8192             # values a round (4 rounds for k3-small's 32768; 20 for K3's 163840)

if triton is not None:
    @triton.jit
    def _argmax_kernel(x_ptr, out_ptr, n, row_stride, col_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        idx = tl.zeros([BLOCK], tl.int32)
        base = x_ptr + row.to(tl.int64) * row_stride
        for start in range(0, n, BLOCK):
            o = start + offs
            best, idx = keep_max(load_row(base, o, n, col_stride), o, best, idx)
        tl.store(out_ptr + row, first_of_max(best, idx, n))


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x `[B, V]` (any strides, fp32 / bf16 / fp16) -> the index of each row's largest value `[B]` int64 (into out
    when given); capturable in a CUDA graph."""
    if x.dim() != 2:
        raise ValueError(f"argmax_rows: logits [B, V], got shape {tuple(x.shape)}")
    if x.device.type != "cuda" or triton is None:
        r = x.argmax(-1)
        return r if out is None else out.copy_(r)
    return launch(x, out)


def launch(x: torch.Tensor, out: torch.Tensor | None = None, block: int = BLOCK) -> torch.Tensor:
    """The Triton program itself on x's device (the tests run it on the CPU under TRITON_INTERPRET=1)."""
    res = out if out is not None and out.dtype == torch.int64 and out.is_contiguous() else \
        torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    _argmax_kernel[(x.shape[0],)](x, res, x.shape[1], x.stride(0), x.stride(1), BLOCK=block, num_warps=8)
    return res if out is None or res is out else out.copy_(res)
