"""Plain-torch Stable LatentMoE routing and latent experts.

Expert weights are stacked: w1, w3 `[E, I, L]`, w2 `[E, L, I]` (nn.Linear `[out, in]` per expert).
"""

from __future__ import annotations

import torch

from ..kda.naive import acc_dtype


def situ_glu(a, b, beta: float, linear_beta: float):
    """`[beta tanh(a/beta) sigmoid(a)] * [lb tanh(b/lb)]` in at least fp32; |out| <= beta * lb."""
    dt = acc_dtype(a, b)
    a, b = a.to(dt), b.to(dt)
    return beta * torch.tanh(a / beta) * torch.sigmoid(a) * (linear_beta * torch.tanh(b / linear_beta))


def router_scores(x, gate_weight):
    """The sigmoid router's scores `[N, E]` for x `[N, d]`, in at least fp32 (`route` ranks them plus the bias)."""
    dt = acc_dtype(x, gate_weight)
    return torch.sigmoid(x.to(dt) @ gate_weight.to(dt).T)


def route(x, gate_weight, bias, top_k: int, renormalize: bool, scaling: float):
    """fp32 sigmoid router; the bias picks the experts but never enters the weights.

    x `[N, d]` -> (expert ids `[N, k]` int64, weights `[N, k]` in at least fp32).
    """
    s = router_scores(x, gate_weight)                                     # [N, E]
    top = torch.topk(s + bias.to(s.dtype), top_k, dim=-1).indices
    w = s.gather(1, top)
    if renormalize and top_k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return top, w * scaling


def expert_mlp(z, w1, w3, w2, beta: float, linear_beta: float):
    """One latent expert: w2(SiTU_GLU(w1 z, w3 z)). Matmuls in z's dtype, the activation in fp32."""
    h = situ_glu(z @ w1.T, z @ w3.T, beta, linear_beta).to(z.dtype)
    return h @ w2.T


def sorted_experts(x, z, gate_weight, bias, top_k: int, renormalize: bool, scaling: float, n_experts: int, expert):
    """Route, then run each hit expert e once on its tokens t (`expert(e, z[t])` -> `[n, L]`) and scatter-add the
    router-weighted outputs in at least fp32 -> u `[N, L]` in z.dtype. Shared by the bf16 and FP8 references."""
    top, w = route(x, gate_weight, bias, top_k, renormalize, scaling)
    dt = acc_dtype(z)
    u = torch.zeros(z.shape, dtype=dt, device=z.device)
    flat = top.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=n_experts).tolist()):
        if n == 0:
            continue
        idx, t = order[start:start + n], tokens[start:start + n]
        u.index_add_(0, t, expert(e, z[t]).to(dt) * w.reshape(-1)[idx].unsqueeze(-1).to(dt))
        start += n
    return u.to(z.dtype)


def moe_sorted(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta):
    """Touches only the experts that received tokens: sort (token, slot) pairs by expert, run each hit expert
    once on its tokens, scatter-add the weighted outputs in fp32. -> u `[N, L]` in z.dtype."""
    return sorted_experts(x, z, gate_weight, bias, top_k, renormalize, scaling, w1.shape[0],
                          lambda e, zt: expert_mlp(zt, w1[e], w3[e], w2[e], beta, linear_beta))


def naive_moe(x, z, gate_weight, bias, w1, w3, w2, top_k, renormalize, scaling, beta, linear_beta):
    """Loop over every expert with a dense coefficient (zero for tokens that skip it): the slow twin."""
    top, w = route(x, gate_weight, bias, top_k, renormalize, scaling)
    dt = acc_dtype(z)
    u = torch.zeros(z.shape, dtype=dt, device=z.device)
    for e in range(w1.shape[0]):
        coef = (w * (top == e)).sum(-1, keepdim=True).to(dt)
        u = u + coef * expert_mlp(z, w1[e], w3[e], w2[e], beta, linear_beta).to(dt)
    return u.to(z.dtype)
