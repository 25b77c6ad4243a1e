"""The k3 MLA ops: `k3::mla_prefill` (expanded causal attention) and `k3::mla_decode` (latent MQA). See
CONTRACT.md. The default implementation is the plain-torch reference in `naive.py`."""

from __future__ import annotations

import torch
from torch import Tensor

from .naive import mla_decode_attention, mla_prefill_attention


@torch.library.custom_op("k3::mla_prefill", mutates_args=())
def mla_prefill(q: Tensor, k: Tensor, v: Tensor, past_len: Tensor, scale: float) -> Tensor:
    """Causal attention of T new queries over `S - T` old keys (valid below past_len[b]) and the T new keys.

    q `[B, T, H, Dqk]`, k `[B, S, H, Dqk]`, v `[B, S, H, Dv]`, past_len `[B]` int64 -> o `[B, T, H, Dv]`.
    Query i of sequence b sits at absolute position past_len[b] + i and sees old rows j < past_len[b] and
    new rows j' <= i. Rows of padded queries are unspecified but finite.
    """
    return mla_prefill_attention(q, k, v, past_len, scale).contiguous()     # contiguous, as the fake says


@mla_prefill.register_fake
def _(q, k, v, past_len, scale):
    return q.new_empty(*q.shape[:3], v.shape[-1])


@torch.library.custom_op("k3::mla_decode", mutates_args=())
def mla_decode(q: Tensor, cache: Tensor, new_row: Tensor, cache_len: Tensor, scale: float, v_dim: int) -> Tensor:
    """Absorbed MLA decode: H query heads share one latent kv head.

    q `[B, H, R]` (R = kv_lora_rank + rope dim: BMM1 output | q_pe), cache `[B, L, R]` with cache_len[b] valid
    rows, new_row `[B, R]` (this token's latent row, attended after the cache). Values are the first v_dim
    columns of each row. Returns `[B, H, v_dim]` in q.dtype. The cache is read, never written.
    """
    return mla_decode_attention(q, cache, new_row, cache_len, scale, v_dim)


@mla_decode.register_fake
def _(q, cache, new_row, cache_len, scale, v_dim):
    return q.new_empty(q.shape[0], q.shape[1], v_dim)


try:  # the Triton kernels register themselves as the CUDA implementations
    from . import kernels  # noqa: F401,E402
except ImportError:
    pass
