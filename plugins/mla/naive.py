"""Plain-torch MLA attention: expanded causal prefill (optionally over old latent rows) and absorbed decode.

Softmax and its products run in at least fp32 (`acc_dtype`); outputs come back in the query's dtype.
"""

from __future__ import annotations

import torch

from ..kda.naive import acc_dtype


def prefill_mask(T: int, S: int, past_len: torch.Tensor) -> torch.Tensor:
    """[B, T, S] bool: keys are `S - T` old rows (valid below past_len[b]) then the T new rows (causal)."""
    old = S - T
    j = torch.arange(S, device=past_len.device)
    i = torch.arange(T, device=past_len.device)
    old_ok = (j[None, None, :] < old) & (j[None, None, :] < past_len[:, None, None])
    new_ok = (j[None, None, :] >= old) & (j[None, None, :] - old <= i[None, :, None])
    return old_ok | new_ok


def mla_prefill_attention(q, k, v, past_len, scale: float):
    """q `[B, T, H, Dqk]`, k `[B, S, H, Dqk]`, v `[B, S, H, Dv]` -> `[B, T, H, Dv]`."""
    dt = acc_dtype(q)
    s = torch.einsum("bthd,bshd->bhts", q.to(dt), k.to(dt)) * scale
    s = s.masked_fill(~prefill_mask(q.shape[1], k.shape[1], past_len)[:, None], float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), v.to(dt)).to(q.dtype)


def mla_decode_attention(q, cache, new_row, cache_len, scale: float, v_dim: int):
    """Latent MQA. q `[B, H, R]` (absorbed query | q_pe), cache `[B, L, R]` (rows below cache_len[b] valid),
    new_row `[B, R]` (this step's row, always attended). Values are the first v_dim columns. -> `[B, H, v_dim]`."""
    dt = acc_dtype(q)
    rows = torch.cat([cache.to(dt), new_row.to(dt).unsqueeze(1)], dim=1)            # [B, L+1, R]
    L = cache.shape[1]
    j = torch.arange(L + 1, device=q.device)
    ok = (j[None, :] < cache_len[:, None]) | (j[None, :] == L)
    s = torch.einsum("bhr,blr->bhl", q.to(dt), rows) * scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    return torch.einsum("bhl,blr->bhr", torch.softmax(s, -1), rows[..., :v_dim]).to(q.dtype)
