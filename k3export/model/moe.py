"""Stable LatentMoE: a full-width fp32 router, experts that run in a narrower latent, and shared experts.

    z = down(x); u = sum_{e in top-k} w_e expert_e(z)  (k3::moe_routed); y = up(RMSNorm(u)) + shared(x)

Routing, the experts and the weighted combine are one op with a routing-independent output shape, so per-expert
token counts never become graph shapes. Eagerly it runs only the experts that received tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from k3export.config import K3Config
from k3export.model.layers import RMSNorm, SituMLP
from k3export.plugins.moe.naive import naive_moe, situ_glu
from k3export.plugins.moe.op import moe_routed


class Router(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32))


class ExpertBank(nn.Module):
    """Routed experts stacked on dim 0 (checkpoint `experts.{e}.w1.weight` is `w1[e]`)."""

    def __init__(self, config: K3Config):
        super().__init__()
        E, I, L = config.num_experts, config.moe_intermediate_size, config.routed_expert_hidden_size
        self.w1 = nn.Parameter(torch.empty(E, I, L))
        self.w3 = nn.Parameter(torch.empty(E, I, L))
        self.w2 = nn.Parameter(torch.empty(E, L, I))


class LatentMoE(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        d, L = config.hidden_size, config.routed_expert_hidden_size
        self.gate = Router(config)
        self.experts = ExpertBank(config)
        self.routed_expert_down_proj = nn.Linear(d, L, bias=False)
        self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps) if config.latent_moe_use_norm else nn.Identity()
        self.routed_expert_up_proj = nn.Linear(L, d, bias=False)
        self.shared_experts = (SituMLP(d, config.moe_intermediate_size * config.num_shared_experts,
                                       config.activation_situ_beta, config.activation_situ_linear_beta)
                               if config.num_shared_experts else None)
        self.routing = dict(top_k=config.num_experts_per_token, renormalize=config.moe_renormalize,
                            scaling=config.routed_scaling_factor, beta=config.activation_situ_beta,
                            linear_beta=config.activation_situ_linear_beta)

    def project(self, x):
        """x `[N, d]` -> (z = down(x) `[N, L]`, shared gate(x), shared up(x) `[N, I_s]`; both None without shared
        experts). `model.packing` swaps in one GEMM for the three."""
        s = self.shared_experts
        return self.routed_expert_down_proj(x), *((s.gate_proj(x), s.up_proj(x)) if s is not None else (None, None))

    def output(self, u, h):
        """up(u) + shared_down(h): u `[N, L]` the normalised routed sum, h `[N, I_s]` the shared SiTU-GLU (None
        without shared experts). `model.packing` swaps in one GEMM over [u | h]."""
        y = self.routed_expert_up_proj(u)
        return y if h is None else y + self.shared_experts.down_proj(h)

    def routed_args(self, x, z):
        e = self.experts
        return (x, z, self.gate.weight, self.gate.e_score_correction_bias, e.w1, e.w3, e.w2)

    def routed(self, x, z):
        """x `[N, d]` (router input), z `[N, L]` -> u `[N, L]`, the routed experts' weighted sum."""
        return moe_routed(*self.routed_args(x, z), **self.routing)

    def project_hidden(self, x):
        """x `[N, d]` -> (z `[N, L]`, h `[N, I_s]` = the shared SiTU-GLU in x.dtype, None without shared experts).
        `model.packing.pack_projections(glu=True)` swaps in one GEMM with the activation in its epilogue."""
        z, s_gate, s_up = self.project(x)
        s = self.shared_experts
        return z, None if s is None else situ_glu(s_gate, s_up, s.beta, s.linear_beta).to(x.dtype)

    def norm_output(self, u, h):
        """output(routed_expert_norm(u), h). `model.packing.pack_projections(fold_norm=True)` swaps in one GEMV that
        normalises u itself at one decode row (`k3::gemv_norm`)."""
        return self.output(self.routed_expert_norm(u), h)

    def _mix(self, x, routed):
        z, h = self.project_hidden(x)
        return self.norm_output(routed(x, z), h)

    def forward(self, x):
        """x `[N, d]` -> `[N, d]`."""
        return self._mix(x, self.routed)

    def forward_naive(self, x):
        """The slow twin: every expert runs on every token with a zero-or-weight coefficient."""
        return self._mix(x, lambda x, z: naive_moe(*self.routed_args(x, z), **self.routing))
