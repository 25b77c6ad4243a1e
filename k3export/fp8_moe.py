"""FP8 routed experts: E4M3 expert banks inside the LatentMoE path, swapped in after the model is built.

`quantize_latent_moe` replaces a `LatentMoE`'s `ExpertBank` with an `FP8ExpertBank` (w1|w3 stacked as w13
`[E, 2I, L]`, w2 `[E, L, I]`, fp32 scales per expert and output channel or per expert) and makes the module an
`FP8LatentMoE`, whose forward calls `k3::moe_routed_fp8` instead of `k3::moe_routed`. Same routing (fp32
router, unchanged), same latent norm and up projection around it.

`k3::moe_routed_fp8` per hit expert e and its tokens t (the contract, as the Q/DQ ONNX export carries it):

    y13 = fp8_linear_ref(z[t], s_z, w13[e], s13[e]);  h = SiTU_GLU(y13[:, :I], y13[:, I:])
    u[t] += w_te * fp8_linear_ref(h, s_h, w2[e], s2[e])

Default implementation (every device): `moe_fp8_sorted`, sorting tokens by expert and running each hit expert's
two FP8 GEMMs through the dequantizing reference. CUDA (`k3export.fp8_moe_kernels`, Triton, no host sync, so
decode CUDA graphs capture it) depends on the number of (token, expert) pairs P = N * top_k:

- P <= WEIGHT_ONLY_PAIRS_PER_EXPERT * E (decode): WEIGHT-ONLY (W8A16), `moe_fp8_wo_ref`: z and h are not
  quantized (z_scale and h_scale unused); each hit expert's E4M3 w1|w3 and w2 stream once, widened in registers
  and scaled per output channel, SiTU-GLU fused into the first GEMM, i.e. `k3::moe_routed` on the dequantized
  experts (h rounded to z.dtype, everything else fp32).
- larger P (prefill): the contract above, on E4M3 tensor cores (z and h quantized with their static scales; at
  K3's latent TMA tilings of 128-row expert blocks, see `k3export.fp8_moe_kernels.FP8_PREFILL_TILINGS`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3export.fp8 import FP8, dequant_weight, fp8_linear_ref, quantize, scale_from_amax, weight_amax
from k3export.model.moe import LatentMoE
from k3export.plugins.kda.naive import acc_dtype
from k3export.plugins.moe.naive import situ_glu, sorted_experts


class FP8ExpertBank(nn.Module):
    """Routed experts in E4M3. w13 `[E, 2I, L]` (w1 rows then w3 rows), w2 `[E, L, I]`; weight scales `[E, out]`
    (per channel) or `[E]`; static input scales for the latent z (w13) and the SiTU-GLU output h (w2)."""

    def __init__(self, E: int, I: int, L: int, per_channel: bool = True, device=None):
        super().__init__()
        self.register_buffer("w13", torch.zeros(E, 2 * I, L, dtype=FP8, device=device))
        self.register_buffer("w2", torch.zeros(E, L, I, dtype=FP8, device=device))
        self.register_buffer("w13_scale", torch.ones((E, 2 * I) if per_channel else (E,), device=device))
        self.register_buffer("w2_scale", torch.ones((E, L) if per_channel else (E,), device=device))
        self.register_buffer("w13_input_scale", torch.ones((), device=device))
        self.register_buffer("w2_input_scale", torch.ones((), device=device))


def _expand(s: Tensor, w: Tensor) -> Tensor:
    return s[..., None] if s.dim() == w.dim() - 1 else s.view(-1, *([1] * (w.dim() - 1)))


CHUNK = 16   # experts quantized at a time: full-width K3 banks are 59 GB in bf16, so no whole-bank temporaries


@torch.no_grad()
def quantize_latent_moe(moe: LatentMoE, s: dict[str, Tensor]) -> None:
    """In place: moe.experts -> FP8ExpertBank from the bank's scales-file entries `s` (keys relative to the
    bank: 'w13_scale', 'w2_scale', 'w13_input_scale', 'w2_input_scale'), and moe becomes an FP8LatentMoE."""
    bank = moe.experts
    E, I, L = bank.w1.shape
    per_channel = s["w13_scale"].dim() == 2
    q = FP8ExpertBank(E, I, L, per_channel, device=bank.w1.device)
    q.w13_scale.copy_(s["w13_scale"])
    q.w2_scale.copy_(s["w2_scale"])
    for c in range(0, E, CHUNK):
        sl = slice(c, c + CHUNK)
        w13 = torch.cat([bank.w1[sl], bank.w3[sl]], dim=1)                             # [c, 2I, L]
        q.w13[sl] = quantize(w13, _expand(q.w13_scale[sl], w13))
        q.w2[sl] = quantize(bank.w2[sl], _expand(q.w2_scale[sl], bank.w2[sl]))
    q.w13_input_scale.copy_(s["w13_input_scale"])
    q.w2_input_scale.copy_(s["w2_input_scale"])
    moe.experts = q
    moe.__class__ = FP8LatentMoE


@torch.no_grad()
def expert_weight_scales(w1: Tensor, w3: Tensor, w2: Tensor, per_channel: bool) -> dict[str, Tensor]:
    """Weight scales of a bank as the scales file stores them: w13 `[E, 2I]` / `[E]`, w2 `[E, L]` / `[E]`
    (w13 = w1 rows then w3 rows; computed CHUNK experts at a time)."""
    a13, a2 = [], []
    for c in range(0, w1.shape[0], CHUNK):
        sl = slice(c, c + CHUNK)
        a = torch.cat([weight_amax(w1[sl], True), weight_amax(w3[sl], True)], dim=1)   # [c, 2I]
        a13.append(a if per_channel else a.amax(-1))
        a2.append(weight_amax(w2[sl], per_channel))
    return {"w13_scale": scale_from_amax(torch.cat(a13)), "w2_scale": scale_from_amax(torch.cat(a2))}


class FP8LatentMoE(LatentMoE):
    """LatentMoE whose routed experts run in FP8 (`k3::moe_routed_fp8`); made by `quantize_latent_moe`."""

    def routed(self, x, z):
        """x `[N, d]` (router input), z `[N, L]` -> u `[N, L]` from the E4M3 experts."""
        e = self.experts
        return moe_routed_fp8(x, z, self.gate.weight, self.gate.e_score_correction_bias, e.w13, e.w2, e.w13_scale,
                              e.w2_scale, e.w13_input_scale, e.w2_input_scale, **self.routing)

    def forward_naive(self, x):
        return self.forward(x)


@torch.library.custom_op("k3::moe_routed_fp8", mutates_args=())
def moe_routed_fp8(x: Tensor, z: Tensor, gate_weight: Tensor, bias: Tensor, w13: Tensor, w2: Tensor,
                   w13_scale: Tensor, w2_scale: Tensor, z_scale: Tensor, h_scale: Tensor, top_k: int,
                   renormalize: bool, scaling: float, beta: float, linear_beta: float) -> Tensor:
    """Routed part of Stable LatentMoE with E4M3 experts.

    x `[N, d]` (router input), z `[N, L]`, gate_weight `[E, d]`, bias `[E]`, w13 `[E, 2I, L]` and w2 `[E, L, I]`
    float8_e4m3fn, w13_scale `[E, 2I]` or `[E]`, w2_scale `[E, L]` or `[E]`, z_scale/h_scale `[]` fp32.
    Returns u `[N, L]` in z.dtype, accumulated in fp32 (or wider).
    """
    return moe_fp8_sorted(x, z, gate_weight, bias, w13, w2, w13_scale, w2_scale, z_scale, h_scale, top_k,
                          renormalize, scaling, beta, linear_beta)


@moe_routed_fp8.register_fake
def _(x, z, gate_weight, bias, w13, w2, w13_scale, w2_scale, z_scale, h_scale, top_k, renormalize, scaling, beta,
      linear_beta):
    return z.new_empty(z.shape)                      # contiguous, like the implementations


def moe_fp8_sorted(x, z, gate_weight, bias, w13, w2, w13_scale, w2_scale, z_scale, h_scale, top_k, renormalize,
                   scaling, beta, linear_beta):
    """The contract's reference: each hit expert runs once on its tokens through two `fp8_linear_ref` GEMMs."""
    I = w2.shape[-1]

    def expert(e, zt):
        y13 = fp8_linear_ref(zt, z_scale, w13[e], w13_scale[e])                      # [n, 2I] in z.dtype
        h = situ_glu(y13[:, :I], y13[:, I:], beta, linear_beta).to(z.dtype)
        return fp8_linear_ref(h, h_scale, w2[e], w2_scale[e])                       # [n, L]
    return sorted_experts(x, z, gate_weight, bias, top_k, renormalize, scaling, w13.shape[0], expert)


def moe_fp8_wo_ref(x, z, gate_weight, bias, w13, w2, w13_scale, w2_scale, top_k, renormalize, scaling, beta,
                   linear_beta):
    """The weight-only reference (CUDA at few pairs): `k3::moe_routed` on the hit experts' dequantized weights,
    rounded as its kernels round (GEMMs and SiTU-GLU in at least fp32, h rounded to z.dtype)."""
    I = w2.shape[-1]
    dt = acc_dtype(z)

    def expert(e, zt):
        y13 = zt.to(dt) @ dequant_weight(w13[e], w13_scale[e], dt).T                 # [n, 2I]
        h = situ_glu(y13[:, :I], y13[:, I:], beta, linear_beta).to(z.dtype)
        return h.to(dt) @ dequant_weight(w2[e], w2_scale[e], dt).T                  # [n, L]
    return sorted_experts(x, z, gate_weight, bias, top_k, renormalize, scaling, w13.shape[0], expert)


@moe_routed_fp8.register_kernel("cuda")
def _(x, z, gate_weight, bias, w13, w2, w13_scale, w2_scale, z_scale, h_scale, top_k, renormalize, scaling, beta,
      linear_beta):
    from k3export.fp8_moe_kernels import moe_fp8_grouped
    return moe_fp8_grouped(x, z, gate_weight, bias, w13, w2, w13_scale, w2_scale, z_scale, h_scale, top_k,
                           renormalize, scaling, beta, linear_beta)
