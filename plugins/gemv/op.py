"""`k3::gemv`: y = x W^T for one decode row, fp32 accumulation, output in x's dtype. Serving only: the compile
backend's decode step calls it through `model.packing.gemv_linears`; the exported graphs keep their linears."""

from __future__ import annotations

import torch
from torch import Tensor


def gemv_ref(x: Tensor, w: Tensor) -> Tensor:
    """The reference of `k3::gemv`: one fp32 product rounded to x.dtype."""
    return (x.float() @ w.float().t()).to(x.dtype)


@torch.library.custom_op("k3::gemv", mutates_args=())
def gemv(x: Tensor, w: Tensor) -> Tensor:
    """x `[..., K]`, w `[N, K]` -> `[..., N]` in x.dtype; the reference (CPU) path accumulates in fp32 like the
    kernel."""
    return gemv_ref(x, w)


@gemv.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def gemv_glu_ref(x: Tensor, w: Tensor, n_plain: int, beta: float, linear_beta: float) -> tuple[Tensor, Tensor]:
    """The reference of `k3::gemv_glu`: one fp32 product, the plain rows rounded to x.dtype, SiTU-GLU of each
    (gate, up) row pair from the fp32 sums, rounded to x.dtype."""
    from k3export.plugins.moe.naive import situ_glu
    y = x.float() @ w.float().t()
    gu = y[..., n_plain:].unflatten(-1, (-1, 2))
    return y[..., :n_plain].to(x.dtype), situ_glu(gu[..., 0], gu[..., 1], beta, linear_beta).to(x.dtype)


@torch.library.custom_op("k3::gemv_glu", mutates_args=())
def gemv_glu(x: Tensor, w: Tensor, n_plain: int, beta: float, linear_beta: float) -> tuple[Tensor, Tensor]:
    """x `[..., K]`, w `[N, K]` whose rows from n_plain on are interleaved gate / up pairs -> (y `[..., n_plain]`,
    h `[..., (N - n_plain) / 2]`), h = SiTU-GLU(gate, up) computed from the fp32 sums (serving: the one-row
    projection of a SiTU MLP or of a LatentMoE with its shared experts, `packing.pack_projections(glu=True)`)."""
    return gemv_glu_ref(x, w, n_plain, beta, linear_beta)


@gemv_glu.register_fake
def _(x, w, n_plain, beta, linear_beta):
    lead = x.shape[:-1]
    return x.new_empty((*lead, n_plain)), x.new_empty((*lead, (w.shape[0] - n_plain) // 2))


def gemv_norm_ref(a: Tensor, b: Tensor, w: Tensor, nw: Tensor, eps: float) -> Tensor:
    """The reference of `k3::gemv_norm`: `RMSNorm` of a (normalised in fp32 or wider, rounded to a.dtype, times nw),
    b after it, then `gemv_ref`."""
    af = a.to(torch.promote_types(a.dtype, torch.float32))
    an = nw * (af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + eps)).to(a.dtype)
    return gemv_ref(torch.cat([an, b], dim=-1), w)


@torch.library.custom_op("k3::gemv_norm", mutates_args=())
def gemv_norm(a: Tensor, b: Tensor, w: Tensor, nw: Tensor, eps: float) -> Tensor:
    """a `[..., KA]`, b `[..., KB]`, w `[N, KA + KB]`, nw `[KA]` -> [rmsnorm(a) * nw | b] @ w^T `[..., N]` in a.dtype
    (serving: LatentMoE's latent norm and output GEMM at one decode row, `packing.NormCols`)."""
    return gemv_norm_ref(a, b, w, nw, eps)


@gemv_norm.register_fake
def _(a, b, w, nw, eps):
    return a.new_empty((*a.shape[:-1], w.shape[0]))


try:  # the Triton kernel registers itself as the CUDA implementation (kernels.py)
    from . import kernels  # noqa: F401,E402
except ImportError:
    pass
