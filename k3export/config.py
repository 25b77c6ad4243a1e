"""K3 configuration: frozen dataclasses, named presets, and the published `config.json` reader.

Field names follow the released `config.json` (`text_config`, model_type `kimi_linear`) so that a value can be
looked up in either place. Each default lives here once; presets override a few fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config field is unknown, missing, unsupported or violates a constraint. The message names the field."""


@dataclass(frozen=True)
class LinearAttnConfig:
    """`linear_attn_config`: the KDA layers. Layer lists are 1-based, as in the published file."""

    num_heads: int = 96
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    use_full_rank_gate: bool = True
    kda_layers: tuple[int, ...] = ()
    full_attn_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class K3Config:
    hidden_size: int = 7168
    vocab_size: int = 163840
    num_hidden_layers: int = 93
    rms_norm_eps: float = 1e-5
    attn_res_block_size: int = 12
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    # Gated MLA
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # Stable LatentMoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    intermediate_size: int = 33792
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        lac = self.linear_attn_config
        if not lac.full_attn_layers and not lac.kda_layers:
            # Derive the published schedule: MLA at l % 4 == 3 and at the last layer (0-based).
            n = self.num_hidden_layers
            mla = sorted({l for l in range(n) if l % 4 == 3} | {n - 1})
            lac = dataclasses.replace(lac, full_attn_layers=tuple(l + 1 for l in mla),
                                      kda_layers=tuple(l + 1 for l in range(n) if l not in mla))
            object.__setattr__(self, "linear_attn_config", lac)
        _validate(self)

    # ---------------------------------------------------------------- derived quantities (never stored twice)
    @property
    def mla_layers(self) -> tuple[int, ...]:
        """0-based indices of the Gated MLA layers."""
        return tuple(l - 1 for l in self.linear_attn_config.full_attn_layers)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """0-based indices of the KDA layers."""
        return tuple(l - 1 for l in self.linear_attn_config.kda_layers)

    def is_mla(self, layer: int) -> bool:
        return layer in self.mla_layers

    def is_dense(self, layer: int) -> bool:
        return layer < self.first_k_dense_replace

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one MLA cache row: normalised latent `c` then the never-rotated `k_pe`."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.linear_attn_config.num_heads * self.linear_attn_config.head_dim

    @property
    def num_attn_res_blocks(self) -> int:
        """Rows of the AttnRes bank: one per seal (layers 0, S, 2S, ...)."""
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    def to_hf(self) -> dict:
        """The `text_config` dict of a published-layout `config.json`."""
        d = dataclasses.asdict(self)
        d["linear_attn_config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in d["linear_attn_config"].items()}
        return {"model_type": "kimi_linear", **d}

    def hash(self) -> str:
        """Stable short hash of every field: graphs and engines record it to refuse a mismatched checkpoint."""
        return hashlib.sha256(json.dumps(self.to_hf(), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: dict, strict: bool = True) -> "K3Config":
        """Build from a `text_config` dict. Unknown fields raise (with the nearest known name) unless strict=False."""
        d = {k: v for k, v in d.items() if k not in _HF_BOOKKEEPING}
        lac_in = dict(d.pop("linear_attn_config", {}) or {})
        known = {f.name for f in dataclasses.fields(cls)}
        lac_known = {f.name for f in dataclasses.fields(LinearAttnConfig)}
        lac_in = {k: v for k, v in lac_in.items() if k not in _LAC_BOOKKEEPING}
        if strict:
            for name, pool, where in ((set(d) - known, known, ""), (set(lac_in) - lac_known, lac_known,
                                                                    "linear_attn_config.")):
                for bad in sorted(name):
                    near = difflib.get_close_matches(bad, sorted(pool), n=1)
                    hint = f"; did you mean '{where}{near[0]}'?" if near else ""
                    raise ConfigError(f"unknown config field '{where}{bad}'{hint} "
                                      "(pass strict=False / --allow-unknown-config to ignore unknown fields)")
        else:
            d = {k: v for k, v in d.items() if k in known}
            lac_in = {k: v for k, v in lac_in.items() if k in lac_known}
        for k in ("kda_layers", "full_attn_layers"):
            if k in lac_in:
                lac_in[k] = tuple(int(x) for x in lac_in[k])
        return cls(**d, linear_attn_config=LinearAttnConfig(**lac_in))

    @classmethod
    def from_hf(cls, path: str | Path, strict: bool = True) -> "K3Config":
        """Read a published `config.json` (a file or the directory holding it); the text model sits under
        `text_config`. The MLA/KDA layer lists come from `linear_attn_config` (derived when absent)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"no config.json at {p}")
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        return cls.from_dict(raw.get("text_config", raw), strict=strict)

    @classmethod
    def from_name(cls, name: str) -> "K3Config":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset '{name}'; choose one of {', '.join(PRESETS)}")
        return PRESETS[name]


# Fields a published config.json carries that describe the file or training, not the text model's math.
_HF_BOOKKEEPING = {
    "model_type", "architectures", "torch_dtype", "dtype", "transformers_version", "auto_map", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "max_position_embeddings",
    "quantization_config", "rope_theta", "rope_scaling", "attention_dropout", "attention_bias", "mlp_bias",
    "output_router_logits", "router_aux_loss_coef", "num_nextn_predict_layers", "head_dim", "pretraining_tp",
    "scoring_func", "topk_method", "n_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob",
}
_LAC_BOOKKEEPING = {"head_k_dim", "head_v_dim"}


def _validate(c: K3Config) -> None:
    lac = c.linear_attn_config

    def need(ok: bool, name: str, constraint: str) -> None:
        if not ok:
            raise ConfigError(f"{name}: {constraint}")

    for name in ("hidden_size", "vocab_size", "num_hidden_layers", "attn_res_block_size", "num_attention_heads",
                 "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_experts",
                 "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size", "intermediate_size"):
        need(getattr(c, name) > 0, name, f"must be > 0, got {getattr(c, name)}")
    need(c.qk_rope_head_dim >= 0, "qk_rope_head_dim", f"must be >= 0, got {c.qk_rope_head_dim}")
    need(c.num_shared_experts >= 0, "num_shared_experts", f"must be >= 0, got {c.num_shared_experts}")
    need(c.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {c.rms_norm_eps}")
    need(lac.num_heads > 0 and lac.head_dim > 0, "linear_attn_config.num_heads/head_dim", "must be > 0")
    need(lac.short_conv_kernel_size >= 2, "linear_attn_config.short_conv_kernel_size",
         f"must be >= 2, got {lac.short_conv_kernel_size}")
    need(float("-inf") < lac.gate_lower_bound < 0, "linear_attn_config.gate_lower_bound",
         f"must lie in (-inf, 0), got {lac.gate_lower_bound}")
    need(lac.use_full_rank_gate, "linear_attn_config.use_full_rank_gate", "only the full-rank output gate (true) "
         "is implemented")
    need(c.num_experts_per_token <= c.num_experts, "num_experts_per_token",
         f"top-k ({c.num_experts_per_token}) must be <= num_experts ({c.num_experts})")
    need(c.num_key_value_heads == c.num_attention_heads, "num_key_value_heads",
         f"must equal num_attention_heads ({c.num_attention_heads}) for MLA, got {c.num_key_value_heads}")
    need(c.mla_use_nope, "mla_use_nope", "only NoPE MLA (true) is implemented; K3 has no RoPE")
    need(c.mla_use_output_gate, "mla_use_output_gate", "only the gated MLA (true) is implemented")
    need(c.moe_router_activation_func == "sigmoid", "moe_router_activation_func",
         f"only 'sigmoid' is implemented, got '{c.moe_router_activation_func}'")
    need(c.num_expert_group == 1 and c.topk_group == 1, "num_expert_group/topk_group",
         "grouped routing is not implemented (K3 uses 1/1)")
    need(c.moe_layer_freq == 1, "moe_layer_freq", f"must be 1 (every layer past the dense ones), got {c.moe_layer_freq}")
    need(0 <= c.first_k_dense_replace <= c.num_hidden_layers, "first_k_dense_replace",
         f"must lie in [0, num_hidden_layers], got {c.first_k_dense_replace}")
    need(c.hidden_act == "situ", "hidden_act", f"only 'situ' is implemented, got '{c.hidden_act}'")
    need(c.activation_situ_beta > 0 and c.activation_situ_linear_beta > 0, "activation_situ_beta/linear_beta",
         "must be > 0")
    need(not c.tie_word_embeddings, "tie_word_embeddings", "K3 unties lm_head; tied embeddings are not implemented")
    layers = set(range(1, c.num_hidden_layers + 1))
    kda, mla = set(lac.kda_layers), set(lac.full_attn_layers)
    need(len(kda) == len(lac.kda_layers) and len(mla) == len(lac.full_attn_layers),
         "linear_attn_config.kda_layers/full_attn_layers", "contain a repeated layer")
    need(not (kda & mla), "linear_attn_config.kda_layers/full_attn_layers",
         f"layers {sorted(kda & mla)} are listed as both KDA and MLA")
    need(kda | mla == layers, "linear_attn_config.kda_layers/full_attn_layers",
         f"together must cover layers 1..{c.num_hidden_layers} (1-based) exactly; "
         f"missing {sorted(layers - kda - mla)}, outside {sorted((kda | mla) - layers)}")


def _tiny() -> K3Config:
    return K3Config(
        hidden_size=64, vocab_size=256, num_hidden_layers=9, attn_res_block_size=3,
        linear_attn_config=LinearAttnConfig(num_heads=4, head_dim=16),
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=3, moe_intermediate_size=24,
        routed_expert_hidden_size=32, intermediate_size=96,
    )


def _small() -> K3Config:
    # ~2.2B parameters (~4.4 GB bf16): K3's head dims (K=V=128, 576 = 512 + 64 latent, qk 192), the
    # 3xKDA + MLA pattern (MLA at 3, 7, 11), dense layer 0, seals at 0, 4, 8 (three sealed bank rows).
    return K3Config(
        hidden_size=2048, vocab_size=32768, num_hidden_layers=12, attn_res_block_size=4,
        linear_attn_config=LinearAttnConfig(num_heads=16, head_dim=128),
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, num_experts=64,
        num_experts_per_token=8, moe_intermediate_size=768, routed_expert_hidden_size=1024, intermediate_size=8192,
    )


PRESETS: dict[str, K3Config] = {"k3": K3Config(), "k3-small": _small(), "k3-tiny": _tiny()}
