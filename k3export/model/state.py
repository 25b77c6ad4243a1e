"""The per-sequence decoding state, as explicit tensors (they become graph inputs and outputs).

Layout, stacked over layers of a kind so the whole state is four tensors:

| tensor      | shape                                  | dtype          | per sequence, full K3            |
|-------------|----------------------------------------|----------------|----------------------------------|
| kda_conv    | [n_kda, B, 3*H*K, W-1]                 | model dtype    | 69 x 36864 x 3 (pre-conv inputs) |
| kda_state   | [n_kda, B, H, K, V]                    | >= fp32        | 69 x 96 x 128 x 128 fp32 (6.3 MB)|
| mla_cache   | [n_mla, B, max_len, kv_lora + rope]    | model dtype    | 24 x 576 values per token        |
| lengths     | [B]                                    | int64          | tokens already in the state      |

Why this layout: the KDA parts are fixed-size whatever the context (the recurrent state keeps the spec's
[H, K, V]; the conv window keeps the spec's [3*H*K, W-1] channel-major order, oldest input first). The MLA
cache is preallocated to `max_len` rows and never reallocated (CUDA graphs capture its address); a step
*returns* its new rows and `commit` writes them, so an exported graph never copies the whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3export.config import K3Config
from k3export.plugins.kda.naive import acc_dtype


@dataclass
class K3State:
    kda_conv: torch.Tensor
    kda_state: torch.Tensor
    mla_cache: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def empty(cls, config: K3Config, batch: int, max_len: int, dtype=torch.float32, device=None) -> "K3State":
        """Zero state for `batch` sequences with room for `max_len` tokens each."""
        lac = config.linear_attn_config
        H, K, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
        n_kda, n_mla = len(config.kda_layers), len(config.mla_layers)
        return cls(
            kda_conv=torch.zeros(n_kda, batch, 3 * H * K, W - 1, dtype=dtype, device=device),
            kda_state=torch.zeros(n_kda, batch, H, K, K, dtype=acc_dtype(torch.empty(0, dtype=dtype)),
                                  device=device),
            mla_cache=torch.zeros(n_mla, batch, max_len, config.latent_dim, dtype=dtype, device=device),
            lengths=torch.zeros(batch, dtype=torch.int64, device=device),
        )

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.mla_cache.shape[2]

    def commit(self, kda_conv, kda_state, new_rows, n_new) -> None:
        """Take a step's outputs: new KDA tensors, and MLA rows `[n_mla, B, T, R]` of which the first n_new[b]
        are real; rows go to positions lengths[b] + i. Raises if a sequence would outgrow `max_len`."""
        n_new = torch.as_tensor(n_new, device=self.lengths.device).expand(self.batch)
        end = self.lengths + n_new
        if int(end.max()) > self.max_len:
            b = int(end.argmax())
            raise ValueError(f"sequence {b} needs {int(end[b])} cache rows but the state holds max_len="
                             f"{self.max_len}; allocate K3State.empty(..., max_len>={int(end[b])})")
        self.kda_conv.copy_(kda_conv)
        self.kda_state.copy_(kda_state)
        T = new_rows.shape[2]
        pos = self.lengths[:, None] + torch.arange(T, device=self.lengths.device)      # [B, T]
        keep = torch.arange(T, device=pos.device)[None, :] < n_new[:, None]
        b_idx = torch.arange(self.batch, device=pos.device)[:, None].expand(-1, T)
        self.mla_cache[:, b_idx[keep], pos[keep]] = new_rows[:, keep].to(self.mla_cache.dtype)
        self.lengths.copy_(end)

    def nbytes(self) -> dict[str, int]:
        return {k: t.numel() * t.element_size() for k, t in
                (("kda_conv", self.kda_conv), ("kda_state", self.kda_state), ("mla_cache", self.mla_cache))}


def state_bytes(config: K3Config, dtype=torch.bfloat16) -> dict[str, int]:
    """Bytes per sequence of the fixed-size KDA state, and MLA cache bytes per token (all layers)."""
    lac = config.linear_attn_config
    H, K, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
    item = torch.empty(0, dtype=dtype).element_size()
    state_item = torch.empty(0, dtype=acc_dtype(torch.empty(0, dtype=dtype))).element_size()
    n_kda, n_mla = len(config.kda_layers), len(config.mla_layers)
    return {
        "kda_conv_per_seq": n_kda * 3 * H * K * (W - 1) * item,
        "kda_state_per_seq": n_kda * H * K * K * state_item,
        "mla_cache_per_token": n_mla * config.latent_dim * item,
    }
