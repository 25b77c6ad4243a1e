"""The k3 AttnRes ops: `k3::attn_res` (the depth mix; what the exported graphs carry), and for serving
`k3::attn_res_norm` (the mix and its consumer's RMSNorm in one launch) and `k3::attn_res_add_norm` (the residual
add before the mix too)."""

from __future__ import annotations

import torch
from torch import Tensor

from .naive import attn_res_add_norm_ref, attn_res_mix, attn_res_norm_ref


@torch.library.custom_op("k3::attn_res", mutates_args=())
def attn_res(bank: Tensor, p: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    """bank `[N, n, d]` (n >= 1 sealed rows), p `[N, d]` -> the depth mix `[N, d]` in p.dtype (fp32 inside)."""
    return attn_res_mix(bank, p, norm_weight, proj_weight, eps)


@attn_res.register_fake
def _(bank, p, norm_weight, proj_weight, eps):
    return p.new_empty(p.shape)                      # contiguous, like the implementation


@torch.library.custom_op("k3::attn_res_norm", mutates_args=())
def attn_res_norm(bank: Tensor, p: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float, out_weight: Tensor,
                  out_eps: float) -> Tensor:
    """RMSNorm_{out_weight}(attn_res(bank, p, ...)) `[N, d]`: the depth mix and the RMSNorm of its consumer in one
    op, for serving (`model.packing.fuse_norms`); the exported graphs keep `k3::attn_res` and the norm apart."""
    return attn_res_norm_ref(bank, p, norm_weight, proj_weight, eps, out_weight, out_eps)


@attn_res_norm.register_fake
def _(bank, p, norm_weight, proj_weight, eps, out_weight, out_eps):
    return p.new_empty(p.shape, dtype=torch.promote_types(out_weight.dtype, p.dtype))


@torch.library.custom_op("k3::attn_res_add_norm", mutates_args=())
def attn_res_add_norm(bank: Tensor, p: Tensor, y: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float,
                      out_weight: Tensor, out_eps: float) -> tuple[Tensor, Tensor]:
    """(p + y, attn_res_norm(bank, p + y, ...)): the residual add that precedes a mix, the mix and the RMSNorm of
    its consumer in one op (serving, `model.packing.fuse_norms`): the GEMM that produced y then needs no fused
    add (cuBLAS's `beta = 1` epilogue costs a copy of p into its output first)."""
    return attn_res_add_norm_ref(bank, p, y, norm_weight, proj_weight, eps, out_weight, out_eps)


@attn_res_add_norm.register_fake
def _(bank, p, y, norm_weight, proj_weight, eps, out_weight, out_eps):
    return p.new_empty(p.shape), p.new_empty(p.shape, dtype=torch.promote_types(out_weight.dtype, p.dtype))


try:  # the Triton kernel registers itself as the CUDA implementation, only with K3_ATTN_RES_TRITON=1 (kernels.py)
    from . import kernels  # noqa: F401,E402
except ImportError:
    pass
