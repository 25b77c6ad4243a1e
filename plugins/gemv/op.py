"""`k3::gemv`: y = x W^T for one decode row, fp32 accumulation, output in x's dtype. Serving only: the compile
backend's decode step calls it through `model.packing.gemv_linears`; the exported graphs keep their linears."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("k3::gemv", mutates_args=())
def gemv(x: Tensor, w: Tensor) -> Tensor:
    """x `[..., K]`, w `[N, K]` -> `[..., N]` in x.dtype; the reference (CPU) path accumulates in fp32 like the
    kernel."""
    return (x.float() @ w.float().t()).to(x.dtype)


@gemv.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


try:  # the Triton kernel registers itself as the CUDA implementation (kernels.py)
    from . import kernels  # noqa: F401,E402
except ImportError:
    pass
