"""KDA (Kimi Delta Attention): linear attention with a fixed-size state per sequence.

State per sequence: conv window `[3*H*K, W-1]` (pre-conv q|k|v inputs, oldest first) and the fp32 recurrent
state `[H, K, V]`. Prefill runs the chunked core (`k3::kda_prefill`); decode runs one fused step
(`k3::kda_decode`; serving: `k3::kda_decode_inplace`, the state updated where it lies). All read the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

from k3export.config import K3Config
from k3export.plugins.kda.naive import head_rmsnorm_gate, short_conv
from k3export.plugins.kda.op import kda_decode, kda_decode_inplace, kda_prefill


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        lac = config.linear_attn_config
        d, H, K, W = config.hidden_size, lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
        self.num_heads, self.head_dim, self.conv_size = H, K, W
        self.lower_bound, self.eps = lac.gate_lower_bound, config.rms_norm_eps
        self.q_proj = nn.Linear(d, H * K, bias=False)
        self.k_proj = nn.Linear(d, H * K, bias=False)
        self.v_proj = nn.Linear(d, H * K, bias=False)
        self.g_proj = nn.Linear(d, H * K, bias=False)            # full-rank output gate
        self.f_a_proj = nn.Linear(d, K, bias=False)              # decay gate, low rank K
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)                # write strength beta
        self.o_proj = nn.Linear(H * K, d, bias=False)
        self.q_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)   # weights only: [H*K, 1, W]
        self.k_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.v_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))        # fp32 by spec
        self.dt_bias = nn.Parameter(torch.zeros(H * K, dtype=torch.float32))
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K))                        # shared by heads

    def conv_weight(self) -> torch.Tensor:
        """`[3*H*K, W]`: the q|k|v depthwise kernels in the conv-state channel order."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)

    def project(self, x):
        """x `[..., d]` -> (q|k|v before the conv `[..., 3HK]`, output gate g `[..., HK]`, f_a(x) `[..., K]`,
        beta logits `[..., H]`). `model.packing` swaps in one GEMM for the six."""
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return qkv, self.g_proj(x), self.f_a_proj(x), self.b_proj(x)

    def prefill(self, x, lengths, conv_state, state):
        """x `[B, T, d]`, lengths `[B]`, conv_state `[B, 3HK, W-1]`, state `[B, H, K, V]`
        -> (y `[B, T, d]`, new conv_state, new state)."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        qkv, g, f_a, beta = self.project(x)                                           # qkv [B, T, 3HK]
        y, u = short_conv(qkv, self.conv_weight(), conv_state)                        # u [B, 3HK, W-1+T]
        q, k, v = torch.nn.functional.silu(y).to(x.dtype).view(B, T, 3, H, K).unbind(2)
        f = self.f_b_proj(f_a).view(B, T, H, K)
        o, new_state = kda_prefill(q, k, v, f, beta, self.A_log, self.dt_bias, state, lengths,
                                   self.lower_bound)                                  # o [B, T, H, V]
        # Next window: the last W-1 pre-conv inputs of each sequence's valid tokens (padded index len .. len+W-2).
        idx = lengths[:, None] + torch.arange(self.conv_size - 1, device=x.device)    # [B, W-1]
        new_conv = u.gather(2, idx[:, None, :].expand(B, u.shape[1], -1)).to(conv_state.dtype)
        o = head_rmsnorm_gate(o, self.o_norm.weight, g.view(B, T, H, K), self.eps)
        return self.o_proj(o.reshape(B, T, H * K).to(x.dtype)), new_conv, new_state

    def decode(self, x, conv_state, state):
        """x `[B, d]` (one token per sequence) -> (y `[B, d]`, new conv_state, new state)."""
        qkv, g, f_a, beta = self.project(x)                                           # qkv [B, 3HK]
        o, new_conv, new_state = kda_decode(qkv, conv_state, self.conv_weight(), self.f_b_proj(f_a), beta,
                                            g, self.A_log, self.dt_bias, self.o_norm.weight,
                                            state, self.lower_bound, self.eps)
        return self.o_proj(o), new_conv, new_state

    def decode_(self, x, conv_state, state):
        """Serving form of `decode`: conv_state and state are updated in place; returns y `[B, d]`. f_b_proj runs
        inside the step's kernel when it is a plain Linear (or the serving `GemvLinear`, the same weight; an FP8
        recipe may quantize it: then it runs here)."""
        qkv, g, f_a, beta = self.project(x)
        fb = self.f_b_proj
        plain = (type(fb) is nn.Linear or getattr(type(fb), "plain_linear", False)) and fb.bias is None
        o = kda_decode_inplace(qkv, conv_state, self.conv_weight(), f_a if plain else fb(f_a),
                               fb.weight if plain else None, beta, g, self.A_log, self.dt_bias, self.o_norm.weight,
                               state, self.lower_bound, self.eps)
        return self.o_proj(o)
