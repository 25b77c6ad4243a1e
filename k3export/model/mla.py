"""Gated MLA (NoPE): 576-wide latent cache rows `[c (kv_lora_rank, normalised) | k_pe (rope dim, never rotated)]`.

Prefill expands K/V per head from the latent rows (old cache rows too, for a continued prefill) and runs causal
attention (`k3::mla_prefill`). Decode absorbs the up projection: BMM1 folds W_UK into the query, the latent
attention runs over the cache rows (`k3::mla_decode`), BMM2 applies W_UV. No K/V is rebuilt for history.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3export.config import K3Config
from k3export.model.layers import RMSNorm
from k3export.plugins.kda.naive import acc_dtype
from k3export.plugins.mla.op import mla_decode, mla_prefill

MLA_NORM_EPS = 1e-6  # the two low-rank norms; every other norm uses rms_norm_eps


class GatedMLA(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        d, H = config.hidden_size, config.num_attention_heads
        self.num_heads, self.rank = H, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.scale = 1.0 / math.sqrt(config.qk_head_dim)
        self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, MLA_NORM_EPS)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, config.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)

    def project(self, x):
        """x `[..., d]` -> (q_a(x) `[..., q_lora_rank]`, kv_a(x) `[..., rank + rope]`, g_proj(x) `[..., H * v]`):
        the three projections of the token itself. `model.packing` swaps in one GEMM for the three."""
        return self.q_a_proj(x), self.kv_a_proj_with_mqa(x), self.g_proj(x)

    def queries(self, q_a):
        """q_a `[..., q_lora_rank]` -> q `[..., H, nope + rope]`."""
        return self.q_b_proj(self.q_a_layernorm(q_a)).unflatten(-1, (self.num_heads, -1))

    def latent_rows(self, kv):
        """kv_a(x) `[..., rank + rope]` -> cache rows: the normalised latent, then k_pe as is."""
        return torch.cat([self.kv_a_layernorm(kv[..., :self.rank]), kv[..., self.rank:]], dim=-1)

    def gated_out(self, g, o):
        """o_proj(sigmoid(g) * o) with g = g_proj(x) (the model dtype) and o `[..., H * v]`."""
        return self.o_proj((torch.sigmoid(g.to(acc_dtype(g))) * o).to(g.dtype))

    def prefill(self, x, old_rows, past_len):
        """x `[B, T, d]`, old_rows `[B, Lc, R]` (valid below past_len[b]; Lc may be 0) -> (y `[B, T, d]`,
        new rows `[B, T, R]` for the cache at positions past_len[b] + i)."""
        B, T, _ = x.shape
        q_a, kv_a, g = self.project(x)
        q = self.queries(q_a)                                                   # [B, T, H, 192]
        rows = self.latent_rows(kv_a)                                           # [B, T, 576]
        keys = torch.cat([old_rows.to(rows.dtype), rows], dim=1)                # [B, Lc+T, 576]
        kv = self.kv_b_proj(keys[..., :self.rank]).unflatten(-1, (self.num_heads, -1))   # [B, S, H, nope+v]
        k_pe = keys[..., None, self.rank:].expand(-1, -1, self.num_heads, -1)   # shared by all heads
        k = torch.cat([kv[..., :self.nope], k_pe], dim=-1)                      # [B, S, H, 192]
        o = mla_prefill(q, k, kv[..., self.nope:].contiguous(), past_len, self.scale)    # [B, T, H, v]
        return self.gated_out(g, o.reshape(B, T, -1)), rows

    def absorbed_weights(self):
        """W_UK `[H, nope, rank]`, W_UV `[H, v, rank]` from kv_b_proj.weight `[H*(nope+v), rank]`."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def decode(self, x, cache, cache_len):
        """x `[B, d]`, cache `[B, L, R]` with cache_len[b] valid rows -> (y `[B, d]`, new row `[B, R]`)."""
        q_a, kv_a, g = self.project(x)
        q = self.queries(q_a)                                                   # [B, H, 192]
        w_uk, w_uv = self.absorbed_weights()
        ql = torch.einsum("bhn,hnr->bhr", q[..., :self.nope], w_uk)             # BMM1: [B, H, rank]
        row = self.latent_rows(kv_a)                                            # [B, 576]
        ol = mla_decode(torch.cat([ql, q[..., self.nope:]], dim=-1), cache, row, cache_len, self.scale,
                        self.rank)                                              # [B, H, rank]
        o = torch.einsum("bhr,hvr->bhv", ol, w_uv)                              # BMM2: [B, H, v]
        return self.gated_out(g, o.flatten(1)), row

    def decode_expanded(self, x, cache, cache_len):
        """The naive twin of `decode`: rebuild per-head K/V for the whole history, then attend."""
        q_a, kv_a, g = self.project(x)
        q = self.queries(q_a).unsqueeze(1)                                      # [B, 1, H, 192]
        rows = torch.cat([cache, self.latent_rows(kv_a).unsqueeze(1)], dim=1)   # [B, L+1, 576]
        kv = self.kv_b_proj(rows[..., :self.rank]).unflatten(-1, (self.num_heads, -1))
        k = torch.cat([kv[..., :self.nope], rows[..., None, self.rank:].expand(-1, -1, self.num_heads, -1)], -1)
        dt = acc_dtype(x)
        s = torch.einsum("bhd,blhd->bhl", q[:, 0].to(dt), k.to(dt)) * self.scale
        L = cache.shape[1]
        j = torch.arange(L + 1, device=x.device)
        ok = (j[None, :] < cache_len[:, None]) | (j[None, :] == L)
        s = s.masked_fill(~ok[:, None], float("-inf"))
        o = torch.einsum("bhl,blhv->bhv", torch.softmax(s, -1), kv[..., self.nope:].to(dt)).to(x.dtype)
        return self.gated_out(g, o.flatten(1))
