"""Plain-torch KDA: the token-by-token ground truth, the chunked (UT-transform) form, and the gate math.

Layouts: q, k, v, g are `[B, T, H, K]` (V = K for K3), beta `[B, T, H]`, the recurrent state `[B, H, K, V]`.
`g` is the log-domain decay (<= 0); `alpha = exp(g)`. Everything runs in at least fp32 (`acc_dtype`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # q, k <- x / sqrt(sum x^2 + 1e-6)


def acc_dtype(*ts: torch.Tensor) -> torch.dtype:
    """At least fp32: promote, never downcast (a float64 run stays float64)."""
    dt = torch.float32
    for t in ts:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """Log decay in (lower_bound, 0): `lb * sigmoid(exp(A_log[h]) * (f + dt_bias))`. f `[..., H, K]`."""
    H, K = f.shape[-2:]
    dt = acc_dtype(f, A_log)
    a = torch.exp(A_log[:H].to(dt)).view(H, 1)          # the checkpoint may store more than H entries
    return lower_bound * torch.sigmoid(a * (f.to(dt) + dt_bias.to(dt).view(H, K)))


def kda_inputs(q, k, f, b, A_log, dt_bias, lower_bound: float):
    """The per-token quantities of the delta rule: normalised/scaled q, k; log decay g; write strength beta."""
    dt = acc_dtype(q, A_log)
    K = q.shape[-1]
    qn = l2norm(q.to(dt)) * K ** -0.5
    kn = l2norm(k.to(dt))
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.to(dt))
    return qn, kn, g, beta


def kda_step(q, k, v, g, beta, S):
    """One delta-rule step. q, k, v, g `[B, H, K]`, beta `[B, H]`, S `[B, H, K, V]` -> (o `[B, H, V]`, S)."""
    S = S * torch.exp(g).unsqueeze(-1)                              # Diag(alpha) S
    u = v - torch.einsum("bhkv,bhk->bhv", S, k)                    # v - S'^T k
    S = S + beta[..., None, None] * k.unsqueeze(-1) * u.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", S, q), S                  # read after the write


def naive_recurrent_kda(q, k, v, g, beta, initial_state=None):
    """Token-by-token ground truth. Returns (o `[B, T, H, V]` in acc dtype, final state `[B, H, K, V]`)."""
    B, T, H, K = q.shape
    dt = acc_dtype(q, v, g)
    S = (torch.zeros(B, H, K, v.shape[-1], dtype=dt, device=q.device) if initial_state is None
         else initial_state.to(dt))
    o = torch.empty(B, T, H, v.shape[-1], dtype=dt, device=q.device)
    for t in range(T):
        o[:, t], S = kda_step(q[:, t].to(dt), k[:, t].to(dt), v[:, t].to(dt), g[:, t].to(dt), beta[:, t].to(dt), S)
    return o, S


def chunk_kda(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """The chunked (UT transform) form of the same recurrence; matches `naive_recurrent_kda` to rounding.

    Inside a chunk with cumulative log decay Gam and entering state S:
        A_kk = strict_lower[beta_i sum_c k_i k_j exp(Gam_i - Gam_j)],  W = (I + A_kk)^-1 beta exp(Gam) K,
        U = (I + A_kk)^-1 beta V,  Vn = U - W S,  O = exp(Gam) Q S + A_qk Vn,
        S <- exp(Gam_C) S + (exp(Gam_C - Gam) K)^T Vn.
    Pairwise decays are formed as exp(Gam_i - Gam_j) with j <= i (never exp(-Gam)), so no exponent overflows.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = acc_dtype(q, v, g)
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T

    def blocks(x):  # [B, T, H, ...] -> [B, H, N, C, ...]; padding is q = k = v = 0, g = 0, beta = 0 (identity steps)
        x = x.to(dt).transpose(1, 2)
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad)) if pad else x
        return x.reshape(B, H, N, C, *x.shape[3:])

    qb, kb, vb, gb, bb = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    S = (torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None
         else initial_state.to(dt).clone())
    idx = torch.arange(C, device=q.device)
    incl = idx[:, None] >= idx[None, :]                              # j <= i
    strict = idx[:, None] > idx[None, :]
    eye = torch.eye(C, dtype=dt, device=q.device)
    out = torch.empty(B, H, N, C, V, dtype=dt, device=q.device)
    for n in range(N):
        qc, kc, vc, bc = qb[:, :, n], kb[:, :, n], vb[:, :, n], bb[:, :, n]
        Gam = gb[:, :, n].cumsum(-2)                                 # [B, H, C, K]
        diff = Gam.unsqueeze(-2) - Gam.unsqueeze(-3)                 # [B, H, C(i), C(j), K]
        D = torch.exp(diff.masked_fill(~incl[..., None], float("-inf")))
        Akk = torch.einsum("bhic,bhjc,bhijc->bhij", kc, kc, D) * bc.unsqueeze(-1) * strict
        Aqk = torch.einsum("bhic,bhjc,bhijc->bhij", qc, kc, D)
        L = eye + Akk                                                # unit lower triangular
        eG = torch.exp(Gam)
        W = torch.linalg.solve_triangular(L, bc.unsqueeze(-1) * eG * kc, upper=False, unitriangular=True)
        U = torch.linalg.solve_triangular(L, bc.unsqueeze(-1) * vc, upper=False, unitriangular=True)
        Vn = U - W @ S
        out[:, :, n] = (eG * qc) @ S + Aqk @ Vn
        last = Gam[:, :, -1:]                                        # [B, H, 1, K]
        S = torch.exp(last).transpose(-1, -2) * S + (torch.exp(last - Gam) * kc).transpose(-1, -2) @ Vn
    o = out.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o, S


def short_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor):
    """Causal depthwise conv over time with a carried window of pre-conv inputs.

    x `[B, T, C]`, weight `[C, W]`, window `[B, C, W-1]` (oldest first). Returns (y `[B, T, C]` in acc dtype,
    the full padded input `[B, C, W-1+T]` from which the caller picks the next window).
    y_t = sum_j weight[:, j] * u_{t-W+1+j}.
    """
    dt = acc_dtype(x, weight)
    u = torch.cat([window.to(dt), x.to(dt).transpose(1, 2)], dim=-1)    # [B, C, W-1+T]
    y = F.conv1d(u, weight.to(dt).unsqueeze(1), groups=weight.shape[0])  # [B, C, T]
    return y.transpose(1, 2), u


def head_rmsnorm_gate(o, weight, gate, eps):
    """o `[..., H, V]`: RMSNorm over V (shared weight), then times sigmoid(gate) in fp32."""
    dt = acc_dtype(o, gate)
    on = o.to(dt) * torch.rsqrt(o.to(dt).pow(2).mean(-1, keepdim=True) + eps)
    return weight * on.to(o.dtype) * torch.sigmoid(gate.to(dt))
