"""Small shared pieces: RMSNorm and the SiTU-GLU MLP (dense layer 0 and the shared experts)."""

from __future__ import annotations

import torch
from torch import nn

from k3export.plugins.kda.naive import acc_dtype
from k3export.plugins.moe.naive import situ_glu


class RMSNorm(nn.Module):
    """y = w * (x * rsqrt(mean(x^2) + eps)) with the normalisation in at least fp32, cast back to x.dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(acc_dtype(x))
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class SituMLP(nn.Module):
    """down(SiTU_GLU(gate(x), up(x))): the dense layer-0 MLP and the always-on shared experts."""

    def __init__(self, dim: int, hidden: int, beta: float, linear_beta: float):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.beta, self.linear_beta = beta, linear_beta

    def project(self, x: torch.Tensor):
        """x -> (gate(x), up(x)); `model.packing` swaps in one GEMM for the two."""
        return self.gate_proj(x), self.up_proj(x)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x -> SiTU_GLU(gate(x), up(x)) `[N, hidden]` in x.dtype (computed in at least fp32);
        `model.packing.pack_projections(glu=True)` swaps in one GEMM with the activation in its epilogue."""
        return situ_glu(*self.project(x), self.beta, self.linear_beta).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))
