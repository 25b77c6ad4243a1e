"""Host-side launch arithmetic shared by the Triton kernel wrappers (`<op>/kernels.py`) and their AOT TensorRT
adapters (`<op>/trt.py`): power-of-two block sizes, the `tl.dot` precision for a dtype, argument checks that raise
a specific ValueError, ceiling division that also works on TensorRT shape expressions, and the ticket counters of
the "last program finishes" launches."""

from __future__ import annotations

import torch
import triton
from torch._subclasses.fake_tensor import is_fake


def pow2(n: int, at_least: int = 16) -> int:
    return max(at_least, triton.next_power_of_2(n))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (tf32 would cost ~1e-3); 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def cdiv(a, b: int):
    """ceil(a / b) for int a, or a TensorRT shape expression a (it overloads + and // with ints)."""
    return (a + (b - 1)) // b


TICKETS_MIN = 1 << 15           # counters per device in the kept buffer (grown, outside a capture, if short)
_TICKETS: dict = {}
_TICKETS_OUTGROWN: list = []    # replaced buffers stay allocated: a CUDA graph captured earlier still uses them


def tickets(like: torch.Tensor, n: int) -> torch.Tensor:
    """n int32 ticket counters at 0 on like's device, for a launch whose last-arriving program finishes the work
    and puts every counter it used back to 0 (the FP8 GEMV's in-launch split-K sum, the MoE decode pairs' fused
    top-k and combine). So one buffer per device, zeroed once when allocated and then kept, serves every such
    launch (no per-call allocation or memset: a CUDA graph captures none). The launches that share it must be
    ordered (one stream, as a decode step is). like traced (fake tensors: the AOTI lowering), or the buffer first
    needed inside a CUDA-graph capture: fresh zeros for this call."""
    if (type(like) is not torch.Tensor or torch._is_functional_tensor(like)) and is_fake(like):   # plain: no probe
        return torch.zeros(n, device=like.device, dtype=torch.int32)
    key = (like.device.type, like.device.index)
    buf = _TICKETS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if like.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, device=like.device, dtype=torch.int32)
    if buf is not None:
        _TICKETS_OUTGROWN.append(buf)
    buf = _TICKETS[key] = torch.zeros(max(n, TICKETS_MIN, 2 * (0 if buf is None else buf.numel())),
                                      device=like.device, dtype=torch.int32)
    return buf
