"""Plain-torch Block AttnRes mix: softmax over depth sources instead of `h + f(h)`."""

from __future__ import annotations

import torch

from ..kda.naive import acc_dtype


def attn_res_mix(bank, p, norm_weight, proj_weight, eps: float):
    """bank `[N, n, d]` (sealed block sums), p `[N, d]` (the pending partial sum) -> `[N, d]` in p.dtype.

    s_j = <RMSNorm_g(V_j), w> over the n+1 sources V = (bank[:, 0..n-1], p); a = softmax_j(s);
    out = sum_j a_j V_j (raw values). fp32 inside.
    """
    dt = acc_dtype(p)
    V = torch.cat([bank.to(dt), p.to(dt).unsqueeze(1)], dim=1)                  # [N, n+1, d]
    gw = norm_weight.to(dt) * proj_weight.reshape(-1).to(dt)                      # [d]
    s = torch.rsqrt(V.pow(2).mean(-1) + eps) * (V * gw).sum(-1)                   # [N, n+1]
    a = torch.softmax(s, dim=-1)
    return (a.unsqueeze(-1) * V).sum(1).to(p.dtype)


def attn_res_norm_ref(bank, p, norm_weight, proj_weight, eps: float, out_weight, out_eps: float):
    """RMSNorm_{out_weight, out_eps}(attn_res_mix(bank, p, ...)), the norm exactly as the model's `RMSNorm`: the mix
    in p.dtype, normalised in at least fp32, cast back to p.dtype, then times out_weight."""
    x = attn_res_mix(bank, p, norm_weight, proj_weight, eps)
    xf = x.to(acc_dtype(x))
    return out_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + out_eps)).to(x.dtype)


def attn_res_add_norm_ref(bank, p, y, norm_weight, proj_weight, eps: float, out_weight, out_eps: float):
    """(p + y, attn_res_norm_ref(bank, p + y, ...)): the add as the model writes it (in p's dtype)."""
    p = p + y
    return p, attn_res_norm_ref(bank, p, norm_weight, proj_weight, eps, out_weight, out_eps)
