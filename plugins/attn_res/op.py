"""The k3 AttnRes op: `k3::attn_res`, so a fused kernel (mix + next RMSNorm) can replace it later."""

from __future__ import annotations

import torch
from torch import Tensor

from .naive import attn_res_mix


@torch.library.custom_op("k3::attn_res", mutates_args=())
def attn_res(bank: Tensor, p: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    """bank `[N, n, d]` (n >= 1 sealed rows), p `[N, d]` -> the depth mix `[N, d]` in p.dtype (fp32 inside)."""
    return attn_res_mix(bank, p, norm_weight, proj_weight, eps)


@attn_res.register_fake
def _(bank, p, norm_weight, proj_weight, eps):
    return p.new_empty(p.shape)                      # contiguous, like the implementation


try:  # the Triton kernel registers itself as the CUDA implementation, only with K3_ATTN_RES_TRITON=1 (kernels.py)
    from . import kernels  # noqa: F401,E402
except ImportError:
    pass
