"""The k3 KDA ops: `k3::kda_prefill` (chunked core), `k3::kda_decode` (fused step) and its serving form
`k3::kda_decode_inplace` (state updated in place). See CONTRACT.md.

The default implementation (every device) is the plain-torch reference in `naive.py`; a device kernel
replaces it with `register_kernel("cuda")`, so the model and the exported graphs never branch on the device.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .naive import acc_dtype, chunk_kda, head_rmsnorm_gate, kda_inputs, kda_step

CHUNK = 64


@torch.library.custom_op("k3::kda_prefill", mutates_args=())
def kda_prefill(q: Tensor, k: Tensor, v: Tensor, f: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                initial_state: Tensor, lengths: Tensor, lower_bound: float) -> tuple[Tensor, Tensor]:
    """KDA prefill core over right-padded sequences.

    q, k, v `[B, T, H, K]` (after short conv + SiLU, before L2 norm), f `[B, T, H, K]` (f_b_proj output),
    b `[B, T, H]` (b_proj logits), A_log `[>=H]`, dt_bias `[H*K]`, initial_state `[B, H, K, V]` (fp32 or wider),
    lengths `[B]` int64 (tokens t >= lengths[b] are padding and leave the state untouched).
    Returns o `[B, T, H, V]` in q.dtype (rows past a sequence's length are unspecified but finite) and the
    final state in initial_state.dtype.
    """
    qn, kn, g, beta = kda_inputs(q, k, f, b, A_log, dt_bias, lower_bound)
    valid = torch.arange(q.shape[1], device=q.device)[None, :] < lengths[:, None]     # [B, T]
    g = g * valid[..., None, None]                                                    # padding: alpha = 1
    beta = beta * valid[..., None]                                                    # padding: no write
    o, S = chunk_kda(qn, kn, v, g, beta, initial_state, CHUNK)
    return o.to(q.dtype).contiguous(), S.to(initial_state.dtype)     # contiguous, as the fake says


@kda_prefill.register_fake
def _(q, k, v, f, b, A_log, dt_bias, initial_state, lengths, lower_bound):
    return q.new_empty(*q.shape[:3], v.shape[-1]), initial_state.new_empty(initial_state.shape)  # contiguous


@torch.library.custom_op("k3::kda_decode", mutates_args=())
def kda_decode(qkv: Tensor, conv_state: Tensor, conv_weight: Tensor, f: Tensor, b: Tensor, g: Tensor,
               A_log: Tensor, dt_bias: Tensor, o_norm_weight: Tensor, state: Tensor, lower_bound: float,
               eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """One fused KDA decode step for B sequences (one new token each).

    qkv `[B, 3*H*K]` (q|k|v projections, pre-conv), conv_state `[B, 3*H*K, W-1]` (previous pre-conv inputs,
    oldest first), conv_weight `[3*H*K, W]`, f `[B, H*K]` (f_b_proj output), b `[B, H]` (b_proj logits),
    g `[B, H*K]` (output-gate logits), A_log `[>=H]`, dt_bias `[H*K]`, o_norm_weight `[K]`,
    state `[B, H, K, V]`. Returns (o `[B, H*V]` in qkv.dtype, new conv_state, new state).
    """
    B, C = qkv.shape
    H = b.shape[-1]
    K = C // (3 * H)
    dt = acc_dtype(qkv, conv_weight)
    window = torch.cat([conv_state.to(dt), qkv.to(dt).unsqueeze(-1)], dim=-1)          # [B, 3HK, W]
    y = torch.nn.functional.silu((window * conv_weight.to(dt)).sum(-1)).to(qkv.dtype)  # same rounding as prefill
    q, k, v = y.view(B, 3, H, K).unbind(1)
    qn, kn, gate, beta = kda_inputs(q, k, f.view(B, H, K), b, A_log, dt_bias, lower_bound)
    o, S = kda_step(qn, kn, v.to(qn.dtype), gate, beta, state.to(qn.dtype))
    o = head_rmsnorm_gate(o.to(qkv.dtype), o_norm_weight, g.view(B, H, K), eps)
    # contiguous: compiled graphs (Inductor/AOTI) assume the fake's strides for the outputs
    return o.reshape(B, H * K).to(qkv.dtype), window[..., 1:].to(conv_state.dtype).contiguous(), S.to(state.dtype)


@kda_decode.register_fake
def _(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias, o_norm_weight, state, lower_bound, eps):
    return (qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3), conv_state.new_empty(conv_state.shape),
            state.new_empty(state.shape))                      # contiguous, like the implementations


@torch.library.custom_op("k3::kda_decode_inplace", mutates_args=("conv_state", "state"))
def kda_decode_inplace(qkv: Tensor, conv_state: Tensor, conv_weight: Tensor, f: Tensor, f_b_weight: Optional[Tensor],
                       b: Tensor, g: Tensor, A_log: Tensor, dt_bias: Tensor, o_norm_weight: Tensor, state: Tensor,
                       lower_bound: float, eps: float) -> Tensor:
    """The serving form of `k3::kda_decode`: the same step, with the new conv window and recurrent state written
    over `conv_state` and `state` (no second buffer, no copy back), returning o `[B, H*V]`. With `f_b_weight`
    `[H*K, r]`, f is `f_a_proj(x)` `[B, r]` and the decay-gate input is `f @ f_b_weight^T` rounded to f.dtype (what
    `f_b_proj` computes; a kernel folds that GEMV into the step); without it f is `[B, H*K]` as in kda_decode.
    Not in the exported graphs (they keep the pure op); `K3Model.forward_decode_` uses it."""
    if f_b_weight is not None:
        f = torch.nn.functional.linear(f, f_b_weight)
    o, new_conv, new_state = kda_decode._init_fn(qkv, conv_state, conv_weight, f, b, g, A_log, dt_bias,
                                                 o_norm_weight, state, lower_bound, eps)
    conv_state.copy_(new_conv)
    state.copy_(new_state)
    return o


@kda_decode_inplace.register_fake
def _(qkv, conv_state, conv_weight, f, f_b_weight, b, g, A_log, dt_bias, o_norm_weight, state, lower_bound, eps):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)


try:  # Triton kernels register themselves as the CUDA implementations of both ops (kernels.py)
    from . import kernels  # noqa: E402,F401
except ImportError:  # no triton: every device keeps the reference above
    pass
