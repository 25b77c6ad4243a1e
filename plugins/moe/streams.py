"""`k3::moe_decode_streams`: a whole Stable LatentMoE sublayer at one decode row, with the shared experts on a second
CUDA stream.

    side stream:  h = SiTU-GLU(x W_gu^T)                                   k3::gemv_glu   (shared gate / up)
    main stream:  z = x W_down^T; u = routed(x, z)                         k3::gemv, k3::moe_routed
    join:         y = [RMSNorm(u) | h] W_out^T                             k3::gemv_norm

In one stream the shared experts' GEMV (and its activation launch) sit on the decode step's critical path between
the AttnRes mix and the router; here they run beside the router, top-k and expert GEMVs, whose launches are
latency bound and leave most of the bandwidth idle. Inside a CUDA-graph capture the fork and join become graph
edges (events), so the Engine's decode graph gets two branches per MoE layer.

Served by `packing.stream_moe` (`CompileBackend(moe_streams=True)`), which needs the glu and fold_norm packs
(the weights are their packed tensors: w_glu = [down rows | gate / up pairs], w_out = [up | shared down]).
Env K3_MOE_STREAMS=0 (read at each call: an A/B switch) keeps every launch on the main stream, same kernels.
The CPU / reference implementation is the composite of the three ops' references.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ..gemv.op import gemv, gemv_glu, gemv_norm
from .op import moe_routed

_SIDE: dict[int, torch.cuda.Stream] = {}       # device index -> the side stream (created once, outside captures)


@torch.library.custom_op("k3::moe_decode_streams", mutates_args=())
def moe_decode_streams(x: Tensor, w_glu: Tensor, n_plain: int, gate_weight: Tensor, bias: Tensor, w1: Tensor,
                       w3: Tensor, w2: Tensor, w_out: Tensor, norm_weight: Tensor, eps: float, top_k: int,
                       renormalize: bool, scaling: float, beta: float, linear_beta: float) -> Tensor:
    """x `[N, d]`; w_glu `[n_plain + 2 I_s, d]` (the routed down projection's n_plain = L rows, then the shared
    experts' gate / up rows interleaved); gate_weight, bias, w1, w3, w2 as `k3::moe_routed`; w_out `[d, L + I_s]`
    ([up | shared down]); norm_weight `[L]` the latent RMSNorm's. Returns `[N, d]` in x.dtype: up(RMSNorm(u)) +
    shared_down(h), as `LatentMoE.forward` computes it with the glu / fold_norm packs."""
    z, h = gemv_glu(x, w_glu, n_plain, beta, linear_beta)
    u = moe_routed(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta)
    return gemv_norm(u, h, w_out, norm_weight, eps)


@moe_decode_streams.register_fake
def _(x, w_glu, n_plain, gate_weight, bias, w1, w3, w2, w_out, norm_weight, eps, top_k, renormalize, scaling, beta,
      linear_beta):
    return x.new_empty((*x.shape[:-1], w_out.shape[0]))


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of a device. Create it before a CUDA-graph capture (the first eager call does)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _SIDE.get(idx)
    if s is None:
        s = _SIDE[idx] = torch.cuda.Stream(device=idx)
    return s


@moe_decode_streams.register_kernel("cuda")
def _cuda(x, w_glu, n_plain, gate_weight, bias, w1, w3, w2, w_out, norm_weight, eps, top_k, renormalize, scaling,
          beta, linear_beta):
    from ..gemv.kernels import gemv_glu_fwd, glu_supported, launch_flags
    w_down, w_gu = w_glu[:n_plain], w_glu[n_plain:]
    if not glu_supported(x, w_gu, 0):
        return moe_decode_streams._init_fn(x, w_glu, n_plain, gate_weight, bias, w1, w3, w2, w_out, norm_weight, eps,
                                           top_k, renormalize, scaling, beta, linear_beta)
    fork = os.environ.get("K3_MOE_STREAMS", "1") != "0"
    main = torch.cuda.current_stream(x.device)
    side = side_stream(x.device) if fork else main
    x2 = x.reshape(-1, x.shape[-1])
    h = x.new_empty(x2.shape[0], w_gu.shape[0] // 2)            # allocated on main: written on side, read after join
    outs = (x.new_empty(x2.shape[0], 0), h)
    if fork:
        side.wait_stream(main)                                   # x is ready
    with torch.cuda.stream(side):
        gemv_glu_fwd(x2, w_gu, 0, beta, linear_beta, outs=outs, **launch_flags(x))
    z = gemv(x, w_down)
    u = moe_routed(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta)
    if fork:
        main.wait_stream(side)                                   # h is ready; x's last reader has finished
    return gemv_norm(u, h.view(*x.shape[:-1], -1), w_out, norm_weight, eps)
