"""`k3export bench layer`: one full-width K3 decode step (B = 1) through an MLA + MoE and a KDA + MoE layer
pair, built from `K3Config()` with the model's own modules and random bf16 weights, against the weight-bytes
floor (every weight the step touches read once: attention, norms, router, latent projections, shared experts,
the 16 routed experts hit, plus the MLA cache rows or the fp32 KDA state read and written).

Both layers share one expert bank (59 GB) so the pair fits one H200; sharing changes no byte a step reads.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import click
import torch

from k3export.bench import bench, command_line, require_cuda
from k3export.bench.ceilings import bench_ms, copy_bandwidth, graph_replay, machine
from k3export.manifest import atomic_write


def _init_(module: torch.nn.Module) -> None:
    """Random weights in place: matrices ~ N(0, 0.02), AttnRes queries 0, norms 1, biases/A_log/dt_bias 0."""
    for name, p in module.named_parameters():
        with torch.no_grad():
            if name.endswith("res_proj.weight"):
                p.zero_()
            elif p.dim() >= 2:
                p.normal_(0, 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()


def build_pair(cache_len: int):
    """(mla_layer, kda_layer, inputs): layers 3 (MLA) and 1 (KDA) of full K3 on the GPU in bf16."""
    from k3export.config import K3Config
    from k3export.model.k3 import DecoderLayer
    cfg = K3Config()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            mla = DecoderLayer(cfg, 3)
        with torch.device("meta"):
            kda = DecoderLayer(cfg, 1)
        del kda.block_sparse_moe
        kda = kda.to_empty(device="cuda")
    finally:
        torch.set_default_dtype(torch.float32)
    _init_(mla)
    _init_(kda)
    kda.block_sparse_moe = mla.block_sparse_moe
    lac = cfg.linear_attn_config
    H, K = lac.num_heads, lac.head_dim
    inputs = dict(
        p=torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16),
        bank=torch.randn(1, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16),
        cache=torch.randn(1, cache_len, cfg.latent_dim, device="cuda", dtype=torch.bfloat16),
        cache_len=torch.full((1,), cache_len, device="cuda", dtype=torch.int64),
        conv=torch.randn(1, 3 * H * K, lac.short_conv_kernel_size - 1, device="cuda", dtype=torch.bfloat16),
        state=torch.randn(1, H, K, K, device="cuda", dtype=torch.float32) * 0.01,
    )
    return cfg, mla, kda, inputs


def decode_step(cfg, layer, i):
    """The body of `K3Model._layers` for one layer and one token, decode path."""
    from k3export.plugins.attn_res.op import attn_res
    eps = cfg.rms_norm_eps
    p, bank = i["p"], i["bank"]
    x = attn_res(bank, p, layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight, eps)
    xn = layer.input_layernorm(x)
    if layer.is_mla:
        y, _ = layer.self_attn.decode(xn, i["cache"], i["cache_len"])
    else:
        y, _, _ = layer.self_attn.decode(xn, i["conv"], i["state"])
    p = p + y
    x = attn_res(bank, p, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
    return p + layer.channel_mixer(layer.post_attention_layernorm(x))


def floor_bytes(cfg, layer, i) -> int:
    moe = layer.block_sparse_moe
    experts = {id(p) for p in moe.experts.parameters()}
    total = sum(p.numel() * p.element_size() for p in layer.parameters() if id(p) not in experts)
    total += cfg.num_experts_per_token * sum(p[0].numel() * p.element_size() for p in moe.experts.parameters())
    if layer.is_mla:
        total += i["cache"].numel() * i["cache"].element_size()
    else:
        total += 2 * (i["state"].numel() * 4 + i["conv"].numel() * 2)
    return total


def _graphed(fn):
    """fn captured in a CUDA graph after two warm-up calls (None when capture fails: a host sync or an allocation it
    cannot replay)."""
    try:
        return graph_replay(fn, warmup=2)
    except Exception as e:  # noqa: BLE001 (reported, not hidden)
        print(f"  CUDA graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def kernel_sources() -> dict:
    import k3export.plugins  # noqa: F401  (registers the ops and whatever kernels import)
    return {op: f"k3export.plugins.{op}.kernels" in sys.modules for op in ("kda", "mla", "moe", "attn_res")}


@bench.command("layer")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/bench"), show_default=True)
@click.option("--cache-len", default=4096, show_default=True, help="MLA cache rows attended")
def layer(out: Path, cache_len: int) -> None:
    """Full-width K3 layer pair (MLA + MoE, KDA + MoE; d = 7168, 896 experts, bf16), one decode step at B = 1,
    vs its weight-bytes floor; eager and CUDA-graph replay."""
    require_cuda("layer")
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    src = kernel_sources()
    print(f"{machine()}; copy {bw / 1e12:.2f} TB/s; Triton kernels loaded: {src}", flush=True)
    cfg, mla, kda, inputs = build_pair(cache_len)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "command": command_line(click.get_current_context(), "k3export bench layer"),
           "copy_TBps": bw / 1e12, "kernels": src, "cache_len": cache_len, "rows": []}
    with torch.inference_mode():
        for name, layer_ in (("MLA+MoE", mla), ("KDA+MoE", kda)):
            fn = lambda: decode_step(cfg, layer_, inputs)  # noqa: E731
            fn()
            nbytes = floor_bytes(cfg, layer_, inputs)
            floor_ms = nbytes / bw * 1e3
            r = {"pair": name, "weight_GB": nbytes / 1e9, "floor_ms": floor_ms, "eager_ms": bench_ms(fn)}
            replay = _graphed(fn)
            if replay is not None:
                r["graph_ms"] = bench_ms(replay)
            best = min(r.get("graph_ms", float("inf")), r["eager_ms"])
            r["x_floor"] = best / floor_ms
            res["rows"].append(r)
            print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                  flush=True)
    atomic_write(out / "layer.json", json.dumps(res, indent=1))
    print(f"wrote {out / 'layer.json'}")
