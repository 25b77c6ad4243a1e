"""The shapes explainer: from X to every projection, k3 op, state update and output, for prefill and decode.

Every shape is measured by running the real modules on the meta device (forward hooks on each `nn.Linear`,
a dispatch mode that sees each `k3::` op call), never typed in. With `tp > 1` the attention modules are built
with their per-rank head counts (KDA/MLA heads sharded, F_a and the 576-wide latent projection replicated),
and the MoE shows the expert bank per rank under expert parallelism (routing stays replicated).
"""

from __future__ import annotations

import dataclasses
import json

import click
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from k3export.config import PRESETS, ConfigError, K3Config
from k3export.model.k3 import DecoderLayer
from k3export.model.state import state_bytes
from k3export.plugins.attn_res.op import attn_res

META = torch.device("meta")
PACK_ALIGN = 16  # serving stacks pad the packed KDA projection to a multiple of 16 columns


class _OpLog(TorchDispatchMode):
    """Records each k3:: op call with its tensor argument and result shapes."""

    def __init__(self, sink):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = (f"k3::{func._opname}" if func.namespace == "k3" else
                "bmm (absorbed MLA)" if func is torch.ops.aten.bmm.default else None)
        if name:
            ins = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
            outs = [list(o.shape) for o in (out if isinstance(out, (tuple, list)) else (out,))]
            self.sink.append({"module": name, "in": ins, "out": outs})
        return out


def _trace(layer: nn.Module, fn) -> list[dict]:
    rows: list[dict] = []
    hooks = [m.register_forward_hook(
        lambda mod, inp, out, name=name: rows.append(
            {"module": name, "in": [list(inp[0].shape)], "out": [list(out.shape)]}))
        for name, m in layer.named_modules() if isinstance(m, nn.Linear)]
    try:
        with _OpLog(rows):
            fn()
    finally:
        for h in hooks:
            h.remove()
    return rows


def local_config(config: K3Config, tp: int) -> K3Config:
    """Per-rank attention config for tensor parallelism over heads."""
    if tp == 1:
        return config
    lac = config.linear_attn_config
    for name, n in (("linear_attn_config.num_heads", lac.num_heads), ("num_attention_heads",
                                                                       config.num_attention_heads),
                    ("num_experts", config.num_experts)):
        if n % tp:
            raise ConfigError(f"{name}: {n} does not divide by --tp {tp}")
    return dataclasses.replace(config, linear_attn_config=dataclasses.replace(lac, num_heads=lac.num_heads // tp),
                               num_attention_heads=config.num_attention_heads // tp,
                               num_key_value_heads=config.num_key_value_heads // tp)


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty(0, dtype=dtype).element_size()


def shape_data(config: K3Config, tokens: int = 8192, batch: int = 1, tp: int = 1, cache: int = 4096,
               dtype=torch.bfloat16) -> dict:
    """Measured shapes for prefill (`batch` x `tokens`) and decode (`batch` sequences, `cache` rows each)."""
    loc = local_config(config, tp)
    d, B, T = config.hidden_size, batch, tokens
    kinds = {"KDA + dense MLP": None, "KDA + LatentMoE": None, "MLA + LatentMoE": None}
    for l in range(config.num_hidden_layers):
        key = ("MLA" if config.is_mla(l) else "KDA") + (" + dense MLP" if config.is_dense(l) else " + LatentMoE")
        if key in kinds and kinds[key] is None:
            kinds[key] = l
    with torch.device(META):
        torch.set_default_dtype(dtype)
        try:
            layers = {k: DecoderLayer(loc, l) for k, l in kinds.items() if l is not None}
        finally:
            torch.set_default_dtype(torch.float32)
    lac = loc.linear_attn_config
    H, K, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
    f32 = torch.float32
    out: dict = {"config": config.hash(), "tp": tp, "tokens": T, "batch": B, "cache": cache, "layers": {},
                 "schedule": {"kda": len(config.kda_layers), "mla": len(config.mla_layers),
                              "dense": config.first_k_dense_replace,
                              "moe": config.num_hidden_layers - config.first_k_dense_replace}}
    for kind, layer in layers.items():
        l = kinds[kind]
        attn, mix = layer.self_attn, layer.channel_mixer
        lengths = torch.full((B,), T, dtype=torch.int64, device=META)
        x_pre = torch.empty(B, T, d, device=META, dtype=dtype)
        x_dec = torch.empty(B, d, device=META, dtype=dtype)
        if layer.is_mla:
            rows = torch.empty(B, cache, config.latent_dim, device=META, dtype=dtype)
            pre = _trace(layer, lambda: attn.prefill(x_pre, rows[:, :0], torch.zeros_like(lengths)))
            dec = _trace(layer, lambda: attn.decode(x_dec, rows, torch.full_like(lengths, cache)))
            keeps = [{"what": "latent cache rows [c | k_pe]", "shape": ["L", config.latent_dim],
                      "bytes_per_token": _nbytes([config.latent_dim], dtype)}]
        else:
            conv = torch.empty(B, 3 * H * K, W - 1, device=META, dtype=dtype)
            st = torch.empty(B, H, K, K, device=META, dtype=f32)
            pre = _trace(layer, lambda: attn.prefill(x_pre, lengths, conv, st))
            dec = _trace(layer, lambda: attn.decode(x_dec, conv, st))
            packed = sum(getattr(attn, n).out_features for n in ("q_proj", "k_proj", "v_proj", "g_proj",
                                                                 "f_a_proj", "b_proj"))
            keeps = [{"what": "conv window (pre-conv q|k|v)", "shape": list(conv.shape[1:]),
                      "bytes_per_seq": _nbytes(conv.shape[1:], dtype)},
                     {"what": "recurrent state S [H, K, V] fp32", "shape": list(st.shape[1:]),
                      "bytes_per_seq": _nbytes(st.shape[1:], f32)}]
            out.setdefault("kda_packed_projection", {"columns": packed,
                                                     "padded": -(-packed // PACK_ALIGN) * PACK_ALIGN})
        h2 = torch.empty(B * T, d, device=META, dtype=dtype)
        h1 = torch.empty(B, d, device=META, dtype=dtype)
        S = config.attn_res_block_size
        n_mlp = l // S + 1                                    # sealed bank rows seen by this layer's MLP-side mix
        bank2 = torch.empty(B * T, n_mlp, d, device=META, dtype=dtype)
        bank1 = torch.empty(B, n_mlp, d, device=META, dtype=dtype)
        pre += _trace(layer, lambda: attn_res(bank2, h2, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, 1e-5))
        dec += _trace(layer, lambda: attn_res(bank1, h1, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, 1e-5))
        pre += _trace(layer, lambda: mix(h2))
        dec += _trace(layer, lambda: mix(h1))
        entry = {"layer": l, "prefill": pre, "decode": dec, "keeps": keeps}
        if hasattr(layer, "block_sparse_moe"):
            e = layer.block_sparse_moe.experts
            ep = config.num_experts // tp
            entry["experts_per_rank"] = {"experts": ep, "w1": [ep, *e.w1.shape[1:]], "w3": [ep, *e.w3.shape[1:]],
                                         "w2": [ep, *e.w2.shape[1:]], "router": [B * T, config.num_experts]}
        out["layers"][kind] = entry
    Hm = config.num_attention_heads
    out["mla_cache_compare"] = {"latent_per_token": config.latent_dim,
                                "mha_per_token": Hm * (config.qk_head_dim + config.v_head_dim),
                                "ratio": Hm * (config.qk_head_dim + config.v_head_dim) / config.latent_dim}
    out["attn_res_bank"] = [T, config.num_attn_res_blocks, d]
    with torch.device(META):
        head = nn.Linear(d, config.vocab_size, bias=False, dtype=dtype)
    out["logits"] = {"prefill": _trace(head, lambda: head(torch.empty(B, T, d, device=META, dtype=dtype))),
                     "decode": _trace(head, lambda: head(torch.empty(B, d, device=META, dtype=dtype)))}
    out["state_bytes"] = state_bytes(loc, dtype)
    return out


def _fmt(shapes) -> str:
    return ", ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes)


def render(data: dict, config: K3Config) -> str:
    """The human-readable report."""
    T, B, tp = data["tokens"], data["batch"], data["tp"]
    s = data["schedule"]
    lines = [f"K3 shapes (config {data['config']}, d={config.hidden_size}, {config.num_hidden_layers} layers: "
             f"{s['kda']} KDA + {s['mla']} MLA, {s['dense']} dense + {s['moe']} LatentMoE)"
             + (f", per rank at TP={tp}" if tp > 1 else ""),
             f"prefill: B={B} sequences x T={T} tokens (X [{B}, {T}, {config.hidden_size}]); "
             f"decode: B={B} sequences, one token each, {data['cache']} cached rows per MLA layer", ""]
    for kind, e in data["layers"].items():
        lines.append(f"== {kind} (first at layer {e['layer']}; the attention-side AttnRes mix and "
                     f"input_layernorm precede it, each module returns [.., {config.hidden_size}])")
        for phase in ("prefill", "decode"):
            lines.append(f"  {phase}:")
            w = max(len(r["module"]) for r in e[phase])
            for r in e[phase]:
                lines.append(f"    {r['module']:<{w}}  {_fmt(r['in'])} -> {_fmt(r['out'])}")
        for k in e["keeps"]:
            size = (f"{k['bytes_per_seq'] / 2**20:.2f} MiB per sequence" if "bytes_per_seq" in k
                    else f"{k['bytes_per_token']} B per token")
            lines.append(f"  keeps across decode steps: {k['what']} {k['shape']} ({size})")
        if "experts_per_rank" in e:
            x = e["experts_per_rank"]
            lines.append(f"  keeps nothing per request; router logits [tokens, {x['router'][1]}] fp32, replicated; "
                         f"expert bank{' per rank (EP)' if tp > 1 else ''}: {x['experts']} experts, "
                         f"w1/w3 {x['w1'][1:]}, w2 {x['w2'][1:]}")
        lines.append("")
    if "kda_packed_projection" in data:
        p = data["kda_packed_projection"]
        lines.append(f"KDA packed projection [q|k|v|g|f_a|b]: {p['columns']} columns, padded to {p['padded']} "
                     f"(F_a replicated)")
    c = data["mla_cache_compare"]
    lines.append(f"MLA cache per token per layer: {c['latent_per_token']} latent values vs {c['mha_per_token']} for "
                 f"{config.num_attention_heads}-head MHA K+V ({c['ratio']:.1f}x smaller)")
    for phase, r in data["logits"].items():
        lines.append(f"lm_head ({phase}): {_fmt(r[0]['in'])} -> logits {_fmt(r[0]['out'])}")
    lines.append(f"AttnRes bank inside one forward: {data['attn_res_bank']} (nothing crosses decode steps)")
    sb = data["state_bytes"]
    lines.append(f"state per sequence{' per rank' if tp > 1 else ''}: KDA conv {sb['kda_conv_per_seq'] / 2**20:.2f} MiB"
                 f" + KDA recurrent {sb['kda_state_per_seq'] / 2**20:.1f} MiB (fixed), MLA "
                 f"{sb['mla_cache_per_token'] / 1024:.1f} KiB per token")
    lines.append("why two graphs: prefill runs KDA chunked (matmuls inside chunks), MLA expanded and MoE as grouped "
                 f"GEMMs; decode runs one fused KDA step on the fixed state, MLA absorbed over the {config.latent_dim}-wide cache "
                 "(no K/V rebuilt) and memory-bound expert reads.")
    return "\n".join(lines)


def shape_report(config: K3Config, tokens: int = 8192, batch: int = 1, tp: int = 1) -> str:
    return render(shape_data(config, tokens, batch, tp), config)


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="k3", show_default=True)
@click.option("--config", "config_path", type=click.Path(exists=True), help="A config.json instead of a preset.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree: per-rank shapes.")
@click.option("--tokens", type=int, default=8192, show_default=True, help="Prefill tokens per sequence.")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences.")
@click.option("--cache", type=int, default=4096, show_default=True, help="Cached tokens for the decode trace.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
def shapes(preset, config_path, tp, tokens, batch, cache, as_json) -> None:
    """Print every projection's input/output shape, each k3 op call, what each module keeps across decode
    steps (with bytes) and each output, for prefill and for decode. Measured on the meta device."""
    if min(tp, tokens, batch, cache) < 1:
        raise click.BadParameter("--tp, --tokens, --batch and --cache must be >= 1")
    try:
        config = K3Config.from_hf(config_path) if config_path else K3Config.from_name(preset)
        data = shape_data(config, tokens, batch, tp, cache)
    except ConfigError as e:
        raise click.ClickException(str(e))
    click.echo(json.dumps(data, indent=1) if as_json else render(data, config))
