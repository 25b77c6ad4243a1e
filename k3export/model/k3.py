"""The K3 text model: embedding, 93 decoder layers glued by Block Attention Residuals, final norm, lm_head.

Two execution paths share one set of weights:
- `forward_prefill`: T tokens per sequence (right padded, with lengths), KDA chunked, MLA expanded, optionally
  continuing from a state (chunked prefill);
- `forward_decode`: one token per sequence at different positions, KDA one fused step, MLA absorbed.
Both are functional (state in, new state and new cache rows out): they are what `torch.export` captures.
`prefill`/`decode` wrap them around a `K3State` for eager use; `model(input_ids)` is a fresh prefill.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from k3export.config import K3Config
from k3export.model.kda import KimiDeltaAttention
from k3export.model.layers import RMSNorm, SituMLP
from k3export.model.mla import GatedMLA
from k3export.model.moe import LatentMoE
from k3export.model.state import K3State
from k3export.plugins.attn_res.op import attn_res


class ResidualQuery(nn.Module):
    """One Block-AttnRes (norm, query) pair: `<name>_res_norm.weight [d]` and `<name>_res_proj.weight [1, d]`."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, d))


class DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer: int):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.index, self.is_mla = layer, config.is_mla(layer)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.self_attention_res_norm = RMSNorm(d, eps)
        self.self_attention_res_proj = ResidualQuery(d)
        self.mlp_res_norm = RMSNorm(d, eps)
        self.mlp_res_proj = ResidualQuery(d)
        self.self_attn = GatedMLA(config) if self.is_mla else KimiDeltaAttention(config)
        if config.is_dense(layer):
            self.mlp = SituMLP(d, config.intermediate_size, config.activation_situ_beta,
                               config.activation_situ_linear_beta)
        else:
            self.block_sparse_moe = LatentMoE(config)

    def channel_mixer(self, x):
        """x `[N, d]` -> `[N, d]`: the dense MLP (layer 0) or LatentMoE."""
        return self.mlp(x) if hasattr(self, "mlp") else self.block_sparse_moe(x)


class K3Backbone(nn.Module):
    """Holds the `model.*` weights of the published layout."""

    def __init__(self, config: K3Config):
        super().__init__()
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(DecoderLayer(config, l) for l in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(d, config.rms_norm_eps)
        self.output_attn_res_proj = ResidualQuery(d)


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.model = K3Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Position of each layer's tensors inside the stacked state (KDA and MLA layers counted separately).
        self.state_slot = {l: (config.mla_layers if config.is_mla(l) else config.kda_layers).index(l)
                           for l in range(config.num_hidden_layers)}

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16, device="cpu",
                        strict_config: bool = True) -> "K3Model":
        """Load a published-layout checkpoint directory (`config.json` + safetensors, sharded or not).

        The model is built on the meta device and each tensor is copied once into its final place. Vision,
        projector and MTP tensors are skipped; missing, unexpected or mis-shaped tensors raise one error that
        names them all."""
        from k3export.model.weights import load_checkpoint
        config = K3Config.from_hf(path, strict=strict_config)
        with torch.device("meta"):
            model = cls(config)
        load_checkpoint(model, Path(path), dtype=dtype, device=device)
        return model.eval()

    def _apply(self, fn, *args, **kwargs):
        """`.to()`, `.cuda()`, `.half()`... copy each weight on its own, so packed GEMMs (`model.packing`) would
        keep the old tensors: they are dropped first (pack again afterwards)."""
        from k3export.model.packing import unpack_projections
        unpack_projections(self)
        return super()._apply(fn, *args, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_state(self, batch: int, max_len: int) -> K3State:
        return K3State.empty(self.config, batch, max_len, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------------------------------ the layer loop
    def _layers(self, h, attention):
        """The Block-AttnRes loop over N token rows. h `[N, d]` (embeddings); `attention(layer, x)` runs the
        token mixer on x `[N, d]` and returns `[N, d]`. Returns the final hidden `[N, d]`."""
        cfg = self.config
        S = cfg.attn_res_block_size
        bank = h.new_empty(h.shape[0], cfg.num_attn_res_blocks, h.shape[1])       # [N, blocks, d]
        n, p, y = 0, h, None           # p: the pending partial sum, y: the sublayer output not yet added to it
        for layer in self.model.layers:
            if n == 0:
                x = layer.input_layernorm(p)
            else:
                p, x = self.add_mix_norm(bank[:, :n], p, y, layer.self_attention_res_norm,
                                         layer.self_attention_res_proj, layer.input_layernorm)
            if layer.index % S == 0:                                              # seal after the attention mix
                bank[:, n] = p
                n, p = n + 1, torch.zeros_like(p)
            y = attention(layer, x)
            p, x = self.add_mix_norm(bank[:, :n], p, y, layer.mlp_res_norm, layer.mlp_res_proj,
                                     layer.post_attention_layernorm)
            y = layer.channel_mixer(x)
        m = self.model
        return self.add_mix_norm(bank[:, :n], p, y, m.output_attn_res_norm, m.output_attn_res_proj, m.norm)[1]

    def add_mix_norm(self, bank, p, y, res_norm, res_query, norm):
        """(p + y, mix_norm(bank, p + y, ...)): a sublayer's residual add and the mix + norm that read it.
        `model.packing.fuse_norms` swaps in one `k3::attn_res_add_norm` launch for the three."""
        p = p + y
        return p, self.mix_norm(bank, p, res_norm, res_query, norm)

    def mix_norm(self, bank, p, res_norm, res_query, norm):
        """norm(AttnRes mix of the sealed rows bank `[N, n, d]` and p `[N, d]`), the mix's (norm, query) pair
        given as modules: what every token mixer, channel mixer and the final norm read. `model.packing.fuse_norms`
        swaps in one `k3::attn_res_norm` launch for the two."""
        return norm(attn_res(bank, p, res_norm.weight, res_query.weight, self.config.rms_norm_eps))

    def forward_prefill(self, input_ids, lengths, kda_conv, kda_state, mla_cache, cache_len):
        """Prefill T new tokens per sequence, continuing from a state.

        input_ids `[B, T]` right padded, lengths `[B]` (new tokens per sequence), kda_conv/kda_state as in
        `K3State`, mla_cache `[n_mla, B, Lc, R]` (rows below cache_len[b] valid; Lc may be 0), cache_len `[B]`.
        Returns logits `[B, T, V]` (fp32 or wider; padded rows unspecified), new kda_conv, new kda_state and
        the new MLA rows `[n_mla, B, T, R]` for positions cache_len[b] + i.
        """
        B, T = input_ids.shape
        h, conv, state, rows = self._prefill(input_ids, lengths, kda_conv, kda_state, mla_cache, cache_len)
        logits = self.lm_head(h).view(B, T, -1)
        return logits.to(_logit_dtype(logits)), conv, state, rows

    def forward_prefill_last(self, input_ids, lengths, kda_conv, kda_state, mla_cache, cache_len):
        """`forward_prefill` with the logits of each sequence's last new token only, `[B, V]` (position
        lengths[b] - 1; a sequence with no new tokens gets position 0's, unspecified): the lm_head runs on B rows
        instead of B x T (K3 at 8192 prompt tokens: 19 TFLOP and a 5.4 GB fp32 logits tensor less). What a serving
        engine needs; the exported graphs keep the full form."""
        B, T = input_ids.shape
        h, conv, state, rows = self._prefill(input_ids, lengths, kda_conv, kda_state, mla_cache, cache_len)
        last = (lengths - 1).clamp(min=0) + torch.arange(B, device=h.device) * T
        logits = self.lm_head(h.index_select(0, last))
        return logits.to(_logit_dtype(logits)), conv, state, rows

    def _prefill(self, input_ids, lengths, kda_conv, kda_state, mla_cache, cache_len):
        """The prefill up to the final norm: -> (h `[B * T, d]`, new kda_conv, new kda_state, new MLA rows)."""
        B, T = input_ids.shape
        new_conv, new_state, rows = [None] * kda_conv.shape[0], [None] * kda_state.shape[0], []

        def attention(layer, x):
            s = self.state_slot[layer.index]
            x = x.view(B, T, -1)
            if layer.is_mla:
                y, r = layer.self_attn.prefill(x, mla_cache[s], cache_len)
                rows.append(r)
            else:
                y, new_conv[s], new_state[s] = layer.self_attn.prefill(x, lengths, kda_conv[s], kda_state[s])
            return y.reshape(B * T, -1)

        h = self._layers(self.model.embed_tokens(input_ids).view(B * T, -1), attention)
        return h, _stack(new_conv, kda_conv), _stack(new_state, kda_state), \
            _stack(rows, mla_cache, (mla_cache.shape[0], B, T, mla_cache.shape[-1]))

    def forward_decode(self, input_ids, kda_conv, kda_state, mla_cache, cache_len):
        """One new token per sequence. input_ids `[B]`, the state as in `forward_prefill` (mla_cache
        `[n_mla, B, L, R]` is read only). Returns logits `[B, V]`, new kda_conv, new kda_state, new MLA rows
        `[n_mla, B, 1, R]` for positions cache_len[b]."""
        new_conv, new_state = [None] * kda_conv.shape[0], [None] * kda_state.shape[0]

        def kda(layer, s, x):
            y, new_conv[s], new_state[s] = layer.self_attn.decode(x, kda_conv[s], kda_state[s])
            return y

        logits, rows = self._decode(input_ids, mla_cache, cache_len, kda)
        return logits, _stack(new_conv, kda_conv), _stack(new_state, kda_state), rows

    def forward_decode_(self, input_ids, kda_conv, kda_state, mla_cache, cache_len):
        """Serving form of `forward_decode`: kda_conv and kda_state are updated in place (each KDA layer's
        `k3::kda_decode_inplace` writes its slice: no stacked copies, no copy back). Returns logits `[B, V]` and
        the new MLA rows `[n_mla, B, 1, R]`. Not exported: the graphs carry the functional form."""
        return self._decode(input_ids, mla_cache, cache_len,
                            lambda layer, s, x: layer.self_attn.decode_(x, kda_conv[s], kda_state[s]))

    def _decode(self, input_ids, mla_cache, cache_len, kda):
        """The decode step around `kda(layer, slot, x) -> y` (a KDA layer's token mixer). -> (logits, rows)."""
        B = input_ids.shape[0]
        rows = []

        def attention(layer, x):
            s = self.state_slot[layer.index]
            if not layer.is_mla:
                return kda(layer, s, x)
            y, r = layer.self_attn.decode(x, mla_cache[s], cache_len)
            rows.append(r.unsqueeze(1))
            return y

        h = self._layers(self.model.embed_tokens(input_ids), attention)
        logits = self.lm_head(h)
        return logits.to(_logit_dtype(logits)), _stack(rows, mla_cache, (mla_cache.shape[0], B, 1,
                                                                          mla_cache.shape[-1]))

    # ------------------------------------------------------------------------------------------ eager API
    def prefill(self, input_ids, state: K3State, lengths=None):
        """Eager prefill into `state` (continuing whatever it holds). input_ids `[B, T]` right padded;
        lengths `[B]` defaults to T. Returns logits `[B, T, V]` and updates the state in place."""
        B, T = input_ids.shape
        lengths = _lengths(lengths, B, T, input_ids.device)
        used = int(state.lengths.max()) if state.batch else 0
        logits, conv, rec, rows = self.forward_prefill(input_ids, lengths, state.kda_conv, state.kda_state,
                                                       state.mla_cache[:, :, :used], state.lengths)
        state.commit(conv, rec, rows, lengths)
        return logits

    def decode(self, input_ids, state: K3State):
        """Eager decode of one token per sequence (`[B]`) at each sequence's own position. Returns `[B, V]`."""
        if int(state.lengths.max()) >= state.max_len:
            raise ValueError(f"the state is full (max_len={state.max_len}); allocate a larger K3State")
        logits, conv, rec, rows = self.forward_decode(input_ids, state.kda_conv, state.kda_state, state.mla_cache,
                                                      state.lengths)
        state.commit(conv, rec, rows, 1)
        return logits

    def forward(self, input_ids, lengths=None):
        """Fresh prefill: input_ids `[B, T]` -> logits `[B, T, V]`."""
        B, T = input_ids.shape
        return self.prefill(input_ids, self.new_state(B, T), lengths)


def _logit_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _lengths(lengths, B, T, device):
    if lengths is None:
        return torch.full((B,), T, dtype=torch.int64, device=device)
    lengths = torch.as_tensor(lengths, dtype=torch.int64, device=device)
    if lengths.shape != (B,) or int(lengths.min()) < 0 or int(lengths.max()) > T:
        raise ValueError(f"lengths must be [B={B}] ints in [0, T={T}], got {lengths.tolist()}")
    return lengths


def _stack(parts, like, empty_shape=None):
    if parts:
        return torch.stack(parts)
    return like.new_empty(empty_shape if empty_shape is not None else like.shape)
