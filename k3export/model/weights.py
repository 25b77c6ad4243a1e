"""Checkpoints in the published layout: key mapping, loading onto a meta-built model, writing, random init.

Published keys sit under `language_model.`; the model's parameter names are those keys without the prefix,
except the routed experts, stacked per layer: `...experts.{e}.w1.weight` is row e of `...experts.w1`.

The release keeps the routed experts in MXFP4 (group 32, spec section 6). The loader decodes an expert matrix
`[N, K]` (w1/w3 `[moe_intermediate, latent]`, w2 `[latent, moe_intermediate]`, K the contiguous input dim) given in
either of two layouts, to the model dtype:
  - `...experts.{e}.w1.blocks` uint8 `[N, K/32, 16]` + `.scales` uint8 `[N, K/32]` (gpt-oss style);
  - `...experts.{e}.w1.weight_packed` uint8 `[N, K/2]` + `.weight_scale` uint8 `[N, K/32]` (+ optional
    `.weight_shape` = [N, K]) (compressed-tensors `mxfp4-pack-quantized` style).
Each byte holds two E2M1 codes, element 2i in the low nibble; a scale byte s is E8M0, 2^(s - 127) (255 = NaN:
rejected). Both layouts are assumed from public MXFP4 releases; neither has been checked against the real K3
release (not obtainable here). Anything else (other dtypes or shapes, half a pair, both layouts or a plain
`.weight` beside one for the same matrix) is a CheckpointError naming the tensor.
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

from k3export.manifest import save_tensors, umask_mode

PREFIX = "language_model."
_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.weight$")
_MXFP4_PART = re.compile(r"^(.+\.experts\.\d+\.w[123])\.(blocks|scales|weight_packed|weight_scale|weight_shape)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Tensor-name endings of quantized weights (MXFP4 blocks/scales, packed int formats).
_QUANT_SUFFIXES = {"blocks", "scales", "weight_packed", "weight_scale", "weight_shape", "scale", "qweight",
                   "weight_global_scale", "weight_zero_point", "qzeros"}
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


# ------------------------------------------------------------------------------------------ MXFP4 experts
MXFP4_GROUP = 32
# The on-disk layouts (save_checkpoint's `experts_format`): (codes part, scales part) of each expert matrix.
MXFP4_FORMATS = {"mxfp4-blocks": ("blocks", "scales"), "mxfp4-packed": ("weight_packed", "weight_scale")}
# OCP MX E2M1: codes 0..7 are these magnitudes, bit 3 the sign (code 8 is -0).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_VALUES = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float64)            # [16]
# E8M0 byte s -> 2^(s - 127), exact in float64 and float32 (2^-127 is a float32 subnormal); 255 is NaN.
_E8M0_VALUES = torch.tensor([math.ldexp(1.0, s - 127) for s in range(255)] + [math.nan], dtype=torch.float64)


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 `[N, K/2]` (element 2i in the low nibble), scales E8M0 uint8 `[N, K/32]` -> `[N, K]` in `dtype`.

    Each value e2m1 * 2^(s - 127) is formed exactly (float32, float64 for a float64 `dtype`); the cast to `dtype`
    is the only rounding. Values beyond float32 come out inf; scale 255 gives NaN (the loader rejects both)."""
    N, G = scales.shape
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(N, G, MXFP4_GROUP).long()  # [N, G, 32]
    compute = torch.promote_types(dtype, torch.float32)
    w = _E2M1_VALUES.to(compute)[codes] * _E8M0_VALUES.to(compute)[scales.long()].unsqueeze(-1)
    return w.view(N, G * MXFP4_GROUP).to(dtype)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` -> (packed uint8 `[N, K/2]`, E8M0 scales uint8 `[N, K/32]`) by the OCP MX recipe: each group of 32
    along K shares the exponent floor(log2(amax)) - 2 (E2M1's largest exponent), clamped to E8M0's range; each
    element / 2^exponent rounds to the nearest E2M1 value (ties to the even code), saturating at +-6; the sign bit
    is the input's (-0 stays code 8)."""
    N, K = w.shape
    if K % MXFP4_GROUP or not torch.isfinite(w).all():
        raise ValueError(f"MXFP4 needs finite values and K a multiple of {MXFP4_GROUP}; got [{N}, {K}]")
    g = w.double().view(N, K // MXFP4_GROUP, MXFP4_GROUP)                                      # [N, G, 32]
    amax_exp = torch.frexp(g.abs().amax(-1)).exponent - 1                                      # floor(log2(amax))
    scales = (amax_exp - 2 + 127).clamp(0, 254).to(torch.uint8)                                # [N, G]
    x = g / _E8M0_VALUES[scales.long()].unsqueeze(-1)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    lo, hi = torch.bucketize(x.abs(), mids), torch.bucketize(x.abs(), mids, right=True)      # differ on a tie
    code = (torch.where(lo % 2 == 0, lo, hi) | x.signbit().long() << 3).view(N, K // 2, 2).to(torch.uint8)
    return code[..., 0] | code[..., 1] << 4, scales


def _mxfp4_expert(base: str, pair: tuple[str, str], parts: dict, shape: tuple[int, int],
                  dtype: torch.dtype) -> torch.Tensor:
    """Check the MXFP4 `pair` of tensors `{base}.{part}` against the model's `shape` [N, K] and decode it to
    `dtype`. Any dtype, shape or value problem raises a CheckpointError naming the tensor."""
    N, K = shape
    codes_key, scales_key = (f"{base}.{p}" for p in pair)
    if K % MXFP4_GROUP:
        raise CheckpointError(f"{codes_key}: the model's matrix is {list(shape)} and K = {K} is not a multiple "
                              f"of the MXFP4 group {MXFP4_GROUP}")
    codes, scales = parts[pair[0]], parts[pair[1]]
    if scales.dtype == torch.float8_e8m0fnu:                       # the same E8M0 byte under torch's own dtype
        scales = scales.view(torch.uint8)
    want_codes = (N, K // MXFP4_GROUP, 16) if pair[0] == "blocks" else (N, K // 2)
    bad = [f"{key}: checkpoint {t.dtype} {list(t.shape)}, model expects torch.uint8 {list(want)} (MXFP4 of "
           f"{list(shape)})" for key, t, want in ((codes_key, codes, want_codes),
                                                  (scales_key, scales, (N, K // MXFP4_GROUP)))
           if t.dtype != torch.uint8 or tuple(t.shape) != want]
    if bad:
        raise CheckpointError("\n  ".join(bad))
    nan = scales == 255
    if nan.any():
        raise CheckpointError(f"{scales_key}: {int(nan.sum())} scale byte(s) are 255 (E8M0 NaN), the first at "
                              f"[row, group] {nan.nonzero()[0].tolist()}")
    w = mxfp4_dequantize(codes.reshape(N, K // 2), scales, dtype)                             # [N, K]
    if not torch.isfinite(w).all():
        raise CheckpointError(f"{scales_key}: scales up to 2^{int(scales.max()) - 127} give values beyond "
                              f"{dtype}'s range")
    return w


def _mxfp4_layout_problem(base: str, names: set[str]) -> str | None:
    """Why the MXFP4 part names seen for one expert matrix are not one complete layout, or None."""
    layouts = [pair + (("weight_shape",) if pair[0] == "weight_packed" else ())
               for pair in MXFP4_FORMATS.values()]
    used = [layout for layout in layouts if names & set(layout)]
    if len(used) > 1:
        return f"{base}: mixes MXFP4 layouts ({', '.join(f'{base}.{n}' for n in sorted(names))})"
    lacking = [n for n in used[0][:2] if n not in names]
    have = ", ".join(f"{base}.{n}" for n in sorted(names))
    return f"{base}: {have} without {', '.join(f'{base}.{n}' for n in lacking)}" if lacking else None


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
    `device` and every checkpoint tensor is read once (memory-mapped) and copied into place; MXFP4 routed experts
    (module docstring) are decoded to `dtype` as soon as both halves of a matrix have been read."""
    expected = {key: (name, row) for key, name, row in checkpoint_keys(model)}
    params = dict(model.named_parameters())
    n_layers = len(model.model.layers)
    shapes = {key: (tuple(params[n].shape[1:]) if r is not None else tuple(params[n].shape))
              for key, (n, r) in expected.items()}
    new = {n: torch.empty(p.shape, dtype=param_dtype(n, dtype), device=device) for n, p in params.items()}
    seen, unexpected, misshaped = set(), [], []
    mxfp4_parts: dict[str, set[str]] = {}              # expert `.weight` key -> MXFP4 part names read
    pending: dict[str, dict[str, torch.Tensor]] = {}   # ... -> codes/scales waiting for the other half
    decoded, mxfp4_bad = set(), []
    for file in _shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                slot = param_slot(key)
                if slot is None:
                    continue
                m = _LAYER.match(slot[0])
                q = _MXFP4_PART.match(key)
                if q and f"{q.group(1)}.weight" in expected:
                    base, part = q.groups()
                    wkey = f"{base}.weight"
                    mxfp4_parts.setdefault(wkey, set()).add(part)
                    t = f.get_tensor(key)
                    if part == "weight_shape":
                        if t.is_floating_point() or t.dtype == torch.bool or t.tolist() != list(shapes[wkey]):
                            mxfp4_bad.append(f"{key}: {t.dtype} {list(t.shape)} holding {t.flatten()[:4].tolist()}"
                                             f", model expects an integer [2] holding {list(shapes[wkey])}")
                        continue
                    held = pending.setdefault(wkey, {})
                    held[part] = t
                    pair = next((p for p in MXFP4_FORMATS.values() if p[0] in held and p[1] in held), None)
                    if pair:
                        name, row = expected[wkey]
                        try:
                            new[name][row].copy_(_mxfp4_expert(base, pair, held, shapes[wkey], new[name].dtype))
                            decoded.add(wkey)
                        except CheckpointError as e:
                            mxfp4_bad.append(str(e))
                        for p in pair:
                            del held[p]
                        if not held:
                            del pending[wkey]
                    continue
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
    for wkey, names in mxfp4_parts.items():
        problem = _mxfp4_layout_problem(wkey.removesuffix(".weight"), names)
        if problem is None and wkey in seen:
            problem = f"{wkey} and its MXFP4 parts {sorted(names)} are both present"
        if problem:
            mxfp4_bad.append(problem)
    missing = [k for k in expected if k not in seen and k not in decoded]
    if missing or unexpected or misshaped or mxfp4_bad:
        parts = []
        quantized = [k for k in unexpected if ".experts." in k and k.rsplit(".", 1)[-1] in _QUANT_SUFFIXES]
        if quantized:
            parts.append(f"the routed experts are stored quantized ({quantized[0]}, ...) in a form this loader "
                         "does not decode (it decodes MXFP4 as .blocks/.scales or .weight_packed/.weight_scale); "
                         "dequantize them to `experts.{e}.w1/w2/w3.weight` first")
        if mxfp4_bad:
            parts.append(f"routed experts are stored quantized but not as MXFP4 this loader decodes ({len(mxfp4_bad)} "
                         "problem(s); layouts in the docstring of k3export/model/weights.py): fix them or dequantize "
                         "them to `experts.{e}.w1/w2/w3.weight` first:\n  " + "\n  ".join(mxfp4_bad))
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


def _mxfp4_experts(sd: dict[str, torch.Tensor], experts_format: str) -> dict[str, torch.Tensor]:
    """`sd` with each routed-expert `.weight` replaced by its `mxfp4_quantize` parts in `experts_format`."""
    codes_part, scales_part = MXFP4_FORMATS[experts_format]
    out = {}
    for key, t in sd.items():
        if not _EXPERT.match(key[len(PREFIX):]):
            out[key] = t
            continue
        base, (N, K) = key.removesuffix(".weight"), t.shape
        try:
            packed, scales = mxfp4_quantize(t)                                      # [N, K/2], [N, K/32]
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        out[f"{base}.{codes_part}"] = packed.view(N, K // MXFP4_GROUP, 16) if codes_part == "blocks" else packed
        out[f"{base}.{scales_part}"] = scales
        if codes_part == "weight_packed":
            out[f"{base}.weight_shape"] = torch.tensor([N, K], dtype=torch.int64)
    return out


def save_checkpoint(model: torch.nn.Module, out: Path, max_shard_bytes: int = 4 << 30,
                    experts_format: str | None = None) -> list[Path]:
    """Write `config.json` and safetensors (sharded with an index above `max_shard_bytes`) in the published
    layout. Written to a temporary directory beside `out`, then renamed: no half-written checkpoint.
    `experts_format` None writes the routed experts in the model dtype; "mxfp4-blocks" / "mxfp4-packed" writes
    them as MXFP4 (`mxfp4_quantize`) in one of the two layouts `load_checkpoint` decodes."""
    if experts_format is not None and experts_format not in MXFP4_FORMATS:
        raise ValueError(f"experts_format: None or one of {sorted(MXFP4_FORMATS)}, got {experts_format!r}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": model.config.to_hf()},
                                                    indent=2))
        sd = published_state_dict(model)
        if experts_format is not None:
            sd = _mxfp4_experts(sd, experts_format)
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
            save_tensors(shard, tmp / name, metadata={"format": "pt"})
        if len(shards) > 1:
            weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
                 "weight_map": weight_map}, indent=2))
        os.chmod(tmp, umask_mode(directory=True))            # mkdtemp made it 0700
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
