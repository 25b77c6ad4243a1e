"""Checkpoints in the published layout: key mapping, loading onto a meta-built model, writing, random init.

Published keys sit under `language_model.`; the model's parameter names are those keys without the prefix,
except the routed experts, stacked per layer: `...experts.{e}.w1.weight` is row e of `...experts.w1`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PREFIX = "language_model."
_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Tensor-name endings of quantized weights (MXFP4 blocks/scales, packed int formats).
_QUANT_SUFFIXES = {"blocks", "scales", "weight_packed", "weight_scale", "weight_shape", "scale", "qweight"}
# Parameters the spec keeps in (at least) fp32 whatever the model dtype.
FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")


class CheckpointError(RuntimeError):
    """A checkpoint does not fit the model; the message lists every offending tensor by name."""


def param_slot(key: str) -> tuple[str, int | None] | None:
    """Published key -> (parameter name, row in a stacked parameter or None); None for tensors a text model
    skips (vision tower, projector, MTP)."""
    if not key.startswith(PREFIX):
        return None
    name = key[len(PREFIX):]
    if ".mtp" in name or name.startswith("mtp"):
        return None
    m = _EXPERT.match(name)
    if m:
        return f"{m.group(1)}.{m.group(3)}", int(m.group(2))
    return name, None


def checkpoint_keys(model: torch.nn.Module):
    """(published key, parameter name, row) for every tensor the model expects, in parameter order."""
    for name, p in model.named_parameters():
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            base, w = name.rsplit(".", 1)
            for e in range(p.shape[0]):
                yield f"{PREFIX}{base}.{e}.{w}.weight", name, e
        else:
            yield PREFIX + name, name, None


def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32) if name.endswith(FP32_PARAMS) else dtype


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({e})") from None
        files = [path / f for f in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"shard files named by the index are missing: {', '.join(missing)}")
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def load_checkpoint(model: torch.nn.Module, path: Path, dtype: torch.dtype, device) -> None:
    """Materialise `model` (built on meta) from the checkpoint at `path`. Each parameter is allocated once on
    `device` and every checkpoint tensor is read once (memory-mapped) and copied into place."""
    expected = {key: (name, row) for key, name, row in checkpoint_keys(model)}
    params = dict(model.named_parameters())
    n_layers = len(model.model.layers)
    shapes = {key: (tuple(params[n].shape[1:]) if r is not None else tuple(params[n].shape))
              for key, (n, r) in expected.items()}
    new = {n: torch.empty(p.shape, dtype=param_dtype(n, dtype), device=device) for n, p in params.items()}
    seen, unexpected, misshaped = set(), [], []
    for file in _shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                slot = param_slot(key)
                if slot is None:
                    continue
                m = _LAYER.match(slot[0])
                if key not in expected:
                    if m and int(m.group(1)) >= n_layers:       # MTP layers stored after the last decoder layer
                        continue
                    unexpected.append(key)
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                want = shapes[key]
                longer_a_log = key.endswith("A_log") and len(shape) == 1 and shape[0] > want[0]
                if shape != want and not longer_a_log:
                    misshaped.append(f"{key}: checkpoint {list(shape)}, model expects {list(want)}")
                    seen.add(key)
                    continue
                name, row = expected[key]
                target = new[name] if row is None else new[name][row]
                # The published A_log may hold more entries than heads (reported: 128); the first H are used.
                target.copy_(f.get_slice(key)[:want[0]] if longer_a_log else f.get_tensor(key))
                seen.add(key)
    missing = [k for k in expected if k not in seen]
    if missing or unexpected or misshaped:
        parts = []
        quantized = [k for k in unexpected if ".experts." in k and k.rsplit(".", 1)[-1] in _QUANT_SUFFIXES]
        if quantized:
            parts.append(f"the routed experts are stored quantized ({quantized[0]}, ...): the released checkpoint "
                         "keeps them in MXFP4, which this loader does not decode yet; dequantize them to "
                         "`experts.{e}.w1/w2/w3.weight` in bf16 first")
        for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if items:
                shown = "\n  ".join(items[:50]) + (f"\n  ... and {len(items) - 50} more" if len(items) > 50 else "")
                parts.append(f"{len(items)} {title} tensor(s):\n  {shown}")
        raise CheckpointError(f"checkpoint {path} does not match the model:\n" + "\n".join(parts))
    for name, t in new.items():
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        mod._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)


def published_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their published keys (experts unstacked; views, no copies)."""
    params = dict(model.named_parameters())
    return {key: (params[n] if r is None else params[n][r]).detach() for key, n, r in checkpoint_keys(model)}


def save_checkpoint(model: torch.nn.Module, out: Path, max_shard_bytes: int = 4 << 30) -> list[Path]:
    """Write `config.json` and safetensors (sharded with an index above `max_shard_bytes`) in the published
    layout. Written to a temporary directory beside `out`, then renamed: no half-written checkpoint."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": model.config.to_hf()},
                                                    indent=2))
        sd = published_state_dict(model)
        shards, cur, size = [], {}, 0
        for k, t in sd.items():
            nbytes = t.numel() * t.element_size()
            if cur and size + nbytes > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[k] = t.contiguous()
            size += nbytes
        shards.append(cur)
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        for name, shard in zip(names, shards):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
        if len(shards) > 1:
            weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
                 "weight_map": weight_map}, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(out.iterdir())


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int = 0) -> None:
    """Deterministic random weights (same seed, same weights, on any machine) scaled so activations stay O(1)
    through every layer: linear weights N(0, 1/fan_in), norm weights 1 + N(0, 0.1^2), AttnRes queries
    N(0, 0.5^2), conv taps N(0, 0.5^2), A_log = log U(1, 16), dt_bias N(0, 1), router bias N(0, 0.3^2)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 2)
        shape = tuple(p.shape)
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1, 16, generator=g).log()
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            t = 0.3 * torch.randn(shape, generator=g)
        elif name.endswith("_res_proj.weight"):
            t = 0.5 * torch.randn(shape, generator=g)
        elif "conv1d" in name:
            t = 0.5 * torch.randn(shape, generator=g)
        elif "norm" in leaf[-2] or name.endswith("o_norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=g)
        else:                                                    # [out, in] or stacked [E, out, in]
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        p.copy_(t)


def random_model(config, seed: int = 0, dtype=torch.float32, device="cpu"):
    """A K3Model with `init_random_` weights."""
    from k3export.model.k3 import K3Model
    with torch.device("meta"):
        model = K3Model(config)
    model.to_empty(device="cpu")
    init_random_(model, seed)
    for name, p in model.named_parameters():
        p.data = p.data.to(dtype=param_dtype(name, dtype), device=device)
    return model.eval().requires_grad_(False)
