"""The k3 MoE op: `k3::moe_routed`, routing + latent experts + weighted combine as one op whose output shape
never depends on routing. See CONTRACT.md. The default implementation is `naive.moe_sorted`."""

from __future__ import annotations

import torch
from torch import Tensor

from .naive import moe_sorted


@torch.library.custom_op("k3::moe_routed", mutates_args=())
def moe_routed(x: Tensor, z: Tensor, gate_weight: Tensor, bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
               top_k: int, renormalize: bool, scaling: float, beta: float, linear_beta: float) -> Tensor:
    """Routed part of Stable LatentMoE.

    x `[N, d]` (router input), z `[N, L]` (routed_expert_down_proj output), gate_weight `[E, d]`, bias `[E]`
    (selection only), w1, w3 `[E, I, L]`, w2 `[E, L, I]`. Returns u = sum_top w_e expert_e(z), `[N, L]` in
    z.dtype, accumulated in fp32. The latent norm and up projection follow outside.
    """
    return moe_sorted(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta)


@moe_routed.register_fake
def _(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta):
    return z.new_empty(z.shape)                      # contiguous, like the implementations


try:  # the Triton kernels register themselves as the CUDA implementation
    from . import kernels  # noqa: F401,E402
except ImportError:
    pass
