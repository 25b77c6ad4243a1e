"""Host-side launch arithmetic shared by the Triton kernel wrappers (`<op>/kernels.py`) and their AOT TensorRT
adapters (`<op>/trt.py`): power-of-two block sizes, the `tl.dot` precision for a dtype, argument checks that raise
a specific ValueError, and ceiling division that also works on TensorRT shape expressions."""

from __future__ import annotations

import torch
import triton


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
