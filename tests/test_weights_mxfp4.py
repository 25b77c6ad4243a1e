"""MXFP4 routed experts in checkpoints: exact E2M1 x E8M0 decoding, the writer's OCP rounding, both on-disk layouts
(gpt-oss `.blocks/.scales`, compressed-tensors `.weight_packed/.weight_scale`) through `K3Model.from_pretrained`,
and a CheckpointError naming the tensor for every form the loader does not accept.

Expected values come from `ref_decode`, written from the OCP MX spec's bit layout (sign, 2 exponent bits, 1 mantissa
bit; E8M0 = 2^(s - 127)) and sharing no code with the loader's lookup tables."""

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3export import K3Config, K3Model
from k3export.model.weights import (CheckpointError, mxfp4_dequantize, mxfp4_quantize, random_model,
                                    save_checkpoint)

TINY = K3Config.from_name("k3-tiny")
# k3-tiny's moe_intermediate_size (24) is not a multiple of the MXFP4 group; 64 also keeps N != K for w1/w2.
TINY32 = dataclasses.replace(TINY, moe_intermediate_size=64)
BASE = "language_model.model.layers.1.block_sparse_moe.experts.2.w2"        # model shape [32, 64]
IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 0, 255, 12, 30, 8, 1]])


def ref_value(code: int, s: int) -> float:
    """One element from the OCP bit layout, in Python floats (exact: at most 2 significant bits)."""
    e, m = (code >> 1) & 3, code & 1
    mag = 0.5 * m if e == 0 else 2.0 ** (e - 1) * (1 + 0.5 * m)
    return (-mag if code & 8 else mag) * 2.0 ** (s - 127)


def ref_decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K/2] (low nibble first), scales uint8 [N, K/32] -> float64 [N, K], vectorised ref_value."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    codes = torch.empty(N, K, dtype=torch.long)
    codes[:, 0::2], codes[:, 1::2] = packed.long() & 15, packed.long() >> 4
    e, m = (codes >> 1) & 3, (codes & 1).double()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).double()) * (1 + 0.5 * m))
    sign = 1.0 - 2.0 * (codes >> 3).double()
    return sign * mag * torch.exp2(scales.double() - 127).repeat_interleave(32, dim=1)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> uint8 [N, K/2], element 2i in the low nibble."""
    return (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8)


# ------------------------------------------------------------------------------------------ the number format
def test_hand_computed_values():
    # byte 0x71: element 0 is code 1 (0.5), element 1 is code 7 (6); both scaled by the row's group scale.
    packed = torch.tensor([[0x71] + [0] * 15, [0xF8] + [0x9A] * 15], dtype=torch.uint8)     # [2, 16]
    w = mxfp4_dequantize(packed, torch.tensor([[127], [128]], dtype=torch.uint8), torch.float32)
    assert w[0, :2].tolist() == [0.5, 6.0] and w[0, 2:].eq(0).all()
    # 0xF8: code 8 (-0) then 15 (-6); 0x9A: code 10 (-1) then 9 (-0.5); row scale 2^1.
    assert w[1, :4].tolist() == [-0.0, -12.0, -2.0, -1.0] and torch.signbit(w[1, 0])
    tiny = mxfp4_dequantize(torch.full((1, 16), 0x17, dtype=torch.uint8), torch.tensor([[0]], dtype=torch.uint8),
                            torch.float32)
    assert tiny[0, :2].tolist() == [2.0 ** -127 * 6, 2.0 ** -128]                         # float32 subnormals
    huge = mxfp4_dequantize(torch.full((1, 16), 0x7E, dtype=torch.uint8), torch.tensor([[254]], dtype=torch.uint8),
                            torch.float64)
    assert huge[0, :2].tolist() == [-4 * 2.0 ** 127, 6 * 2.0 ** 127]


def test_every_code_and_scale_decodes_exactly():
    scales = torch.tensor([0, 1, 2, 60, 126, 127, 128, 129, 200, 251, 252, 253, 254], dtype=torch.uint8)
    G = len(scales)
    g = torch.Generator().manual_seed(0)
    codes = torch.stack([torch.randperm(16, generator=g).repeat(2) for _ in range(3 * G)]).view(3, G * 32)
    scale_rows = torch.stack([scales.roll(r) for r in range(3)])                            # [3, G]
    want = ref_decode(pack(codes), scale_rows)
    assert want.abs().max() == 6 * 2.0 ** 127 and want[want != 0].abs().min() == 2.0 ** -128
    spot = [(r, c, int(codes[r, c]), int(scale_rows[r, c // 32])) for r in range(3) for c in (0, 33, 100, 415)]
    assert all(want[r, c].item() == ref_value(code, s) for r, c, code, s in spot)
    assert torch.equal(mxfp4_dequantize(pack(codes), scale_rows, torch.float64), want)
    # float32 (and bf16, same exponent range) hold every value up to scale 252; above, 4 and 6 overflow.
    fits = (scale_rows <= 252).repeat_interleave(32, dim=1)
    for dtype in (torch.float32, torch.bfloat16):
        got = mxfp4_dequantize(pack(codes), scale_rows, dtype)
        assert got.dtype == dtype and torch.equal(got[fits], want[fits].to(dtype))
        assert torch.equal(got[fits].double(), want[fits])                                  # no rounding at all
    assert torch.equal(torch.signbit(mxfp4_dequantize(pack(codes), scale_rows, torch.float32)), codes >= 8)


def test_quantize_rounds_to_nearest_even_and_saturates():
    # One group, amax 7.9: scale 2^(floor(log2 7.9) - 2) = 2^0; ties go to the even code, 7.9 saturates at 6.
    vals = [0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, -2.9, -0.2, 0.0, 7.9, -6.0]
    want = [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -3.0, -0.0, 0.0, 6.0, -6.0]
    x = torch.zeros(1, 32, dtype=torch.float64)
    x[0, :len(vals)] = torch.tensor(vals, dtype=torch.float64)
    packed, scales = mxfp4_quantize(x)
    assert scales.tolist() == [[127]]
    assert mxfp4_dequantize(packed, scales, torch.float64)[0, :len(vals)].tolist() == want
    # Scale = floor(log2(amax)) - 2 per group: amax 1e-3 -> 2^-12, 0.3 -> 2^-4, 100 -> 2^4, 0 -> anything.
    y = torch.zeros(4, 32)
    y[0, 5], y[1, 0], y[2, 31] = 1e-3, -0.3, 100.0
    assert mxfp4_quantize(y)[1].flatten()[:3].tolist() == [127 - 12, 127 - 4, 127 + 4]
    assert mxfp4_dequantize(*mxfp4_quantize(y), torch.float32)[3].eq(0).all()


def test_quantize_is_lossless_on_mxfp4_values():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 128), generator=g)
    codes[:, ::32] = 7                                        # every group reaches amax 6 * 2^(s - 127)
    scales = torch.randint(1, 250, (8, 4), generator=g, dtype=torch.uint8)
    w = mxfp4_dequantize(pack(codes), scales, torch.float32)
    assert torch.equal(mxfp4_quantize(w)[0], pack(codes)) and torch.equal(mxfp4_quantize(w)[1], scales)


# ------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The same random k3-tiny (moe_intermediate 64) written plain and in both MXFP4 layouts."""
    root = tmp_path_factory.mktemp("mx")
    model = random_model(TINY32, seed=5)
    save_checkpoint(model, root / "blocks", experts_format="mxfp4-blocks")
    save_checkpoint(model, root / "packed", experts_format="mxfp4-packed", max_shard_bytes=20_000)
    return root, model


def _shards(path):
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def expected_experts(sd, layout):
    """Stacked expert name -> float64 [E, N, K] decoded by ref_decode from the written bytes."""
    codes_part, scales_part = {"blocks": ("blocks", "scales"), "packed": ("weight_packed", "weight_scale")}[layout]
    out = {}
    for key in sd:
        if key.endswith("." + codes_part):
            base = key.rsplit(".", 1)[0]
            layer_experts, e, w = base.removeprefix("language_model.").rsplit(".", 2)
            packed = sd[key].reshape(sd[key].shape[0], -1)
            out.setdefault(f"{layer_experts}.{w}", {})[int(e)] = ref_decode(packed, sd[f"{base}.{scales_part}"])
    return {n: torch.stack([rows[e] for e in sorted(rows)]) for n, rows in out.items()}


@pytest.mark.parametrize("layout", ["blocks", "packed"])
def test_mxfp4_checkpoint_loads_exactly(tmp_path, ckpts, layout):
    root, model = ckpts
    path = root / layout
    sd = _shards(path)
    assert f"{BASE}.{'blocks' if layout == 'blocks' else 'weight_packed'}" in sd and f"{BASE}.weight" not in sd
    if layout == "packed":
        assert len(list(path.glob("*.safetensors"))) > 3 and sd[f"{BASE}.weight_shape"].tolist() == [32, 64]
    else:
        assert tuple(sd[f"{BASE}.blocks"].shape) == (32, 2, 16) and tuple(sd[f"{BASE}.scales"].shape) == (32, 2)
    want = expected_experts(sd, layout)
    assert len(want) == 3 * (TINY32.num_hidden_layers - TINY32.first_k_dense_replace)      # w1, w2, w3 per MoE layer
    loaded = K3Model.from_pretrained(path, dtype=torch.float32)
    params, orig = dict(loaded.named_parameters()), dict(model.named_parameters())
    for name, w in want.items():
        assert torch.equal(params[name].double(), w), name
        rel = ((w - orig[name].double()).norm() / orig[name].double().norm()).item()
        assert 0 < rel < 0.2, (name, rel)          # MXFP4 of Gaussian weights: ~0.11 measured; not the raw weights
    assert all(torch.equal(p, orig[n]) for n, p in params.items() if n not in want)

    # The same weights in plain form: dequantized experts written as ordinary fp32 `.weight` tensors.
    plain_model = random_model(TINY32, seed=5)
    for name, w in want.items():
        dict(plain_model.named_parameters())[name].copy_(w.float())
    save_checkpoint(plain_model, tmp_path / "plain")
    for dtype in (torch.float32, torch.bfloat16):
        a = K3Model.from_pretrained(path, dtype=dtype)
        b = K3Model.from_pretrained(tmp_path / "plain", dtype=dtype)
        assert torch.equal(a(IDS), b(IDS)), dtype


def test_e8m0_scales_under_torch_dtype(tmp_path, ckpts):
    # Scales stored as torch.float8_e8m0fnu (safetensors F8_E8M0) are the same bytes as uint8 E8M0.
    root, _ = ckpts
    sd = _shards(root / "packed")
    for k in [k for k in sd if k.endswith(".weight_scale")]:
        sd[k] = sd[k].view(torch.float8_e8m0fnu)
    out = _write(tmp_path / "e8", root / "packed", sd)
    a, b = K3Model.from_pretrained(out, dtype=torch.float32), K3Model.from_pretrained(root / "packed", torch.float32)
    assert torch.equal(a(IDS), b(IDS))


def _write(out, like, sd):
    out.mkdir()
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text((like / "config.json").read_text())
    return out


def _bad_shape(sd):
    sd[f"{BASE}.blocks"] = sd[f"{BASE}.blocks"].reshape(32, 4, 8)
    return sd


def _transposed(sd):
    sd[f"{BASE}.scales"] = torch.full((64, 1), 127, dtype=torch.uint8)
    return sd


def _fp8_scale(sd):       # NVFP4-like: an e4m3 scale where E8M0 belongs
    sd[f"{BASE}.scales"] = sd[f"{BASE}.scales"].float().to(torch.float8_e4m3fn)
    return sd


def _nan_scale(sd):
    sd[f"{BASE}.scales"][3, 1] = 255
    return sd


def _overflow(sd):        # 2^127 * 6 is beyond float32
    sd[f"{BASE}.scales"][0, 0] = 254
    sd[f"{BASE}.blocks"][0, 0, 0] = 0x77
    return sd


def _no_scales(sd):
    del sd[f"{BASE}.scales"]
    return sd


def _no_blocks(sd):
    del sd[f"{BASE}.blocks"]
    return sd


def _mixed(sd):
    sd[f"{BASE}.weight_scale"] = sd.pop(f"{BASE}.scales")
    return sd


def _mixed_extra(sd):
    sd[f"{BASE}.weight_packed"] = sd[f"{BASE}.blocks"].reshape(32, 32).clone()
    return sd


def _plain_too(sd):
    sd[f"{BASE}.weight"] = torch.zeros(32, 64)
    return sd


def _weight_shape_in_blocks(sd):
    sd[f"{BASE}.weight_shape"] = torch.tensor([32, 64])
    return sd


@pytest.mark.parametrize("mutate,needles", [
    (_bad_shape, [f"{BASE}.blocks: checkpoint torch.uint8 [32, 4, 8], model expects torch.uint8 [32, 2, 16] "
                  "(MXFP4 of [32, 64])", f"1 missing tensor(s):\n  {BASE}.weight"]),
    (_transposed, [f"{BASE}.scales: checkpoint torch.uint8 [64, 1], model expects torch.uint8 [32, 2]"]),
    (_fp8_scale, [f"{BASE}.scales: checkpoint torch.float8_e4m3fn [32, 2], model expects torch.uint8 [32, 2]"]),
    (_nan_scale, [f"{BASE}.scales: 1 scale byte(s) are 255 (E8M0 NaN), the first at [row, group] [3, 1]"]),
    (_overflow, [f"{BASE}.scales: scales up to 2^127 give values beyond torch.float32's range"]),
    (_no_scales, [f"{BASE}: {BASE}.blocks without {BASE}.scales", f"{BASE}.weight"]),
    (_no_blocks, [f"{BASE}: {BASE}.scales without {BASE}.blocks"]),
    (_mixed, [f"{BASE}: mixes MXFP4 layouts ({BASE}.blocks, {BASE}.weight_scale)"]),
    (_mixed_extra, [f"{BASE}: mixes MXFP4 layouts ({BASE}.blocks, {BASE}.scales, {BASE}.weight_packed)"]),
    (_weight_shape_in_blocks, [f"{BASE}: mixes MXFP4 layouts ({BASE}.blocks, {BASE}.scales, {BASE}.weight_shape)"]),
    (_plain_too, [f"{BASE}.weight and its MXFP4 parts ['blocks', 'scales'] are both present"]),
])
def test_blocks_errors_name_the_tensor(tmp_path, ckpts, mutate, needles):
    root, _ = ckpts
    out = _write(tmp_path / "bad", root / "blocks", mutate(_shards(root / "blocks")))
    with pytest.raises(CheckpointError, match="stored quantized but not as MXFP4 .*dequantize") as e:
        K3Model.from_pretrained(out, dtype=torch.float32)
    for needle in needles:
        assert needle in str(e.value), str(e.value)
    assert str(e.value).count("\n  language_model.") <= 2            # only the mutated matrix is reported


@pytest.mark.parametrize("value,dtype", [([32, 63], torch.int64), ([64, 32], torch.int32), ([32., 64.], torch.float32)])
def test_packed_weight_shape_is_checked(tmp_path, ckpts, value, dtype):
    root, _ = ckpts
    sd = _shards(root / "packed")
    sd[f"{BASE}.weight_shape"] = torch.tensor(value, dtype=dtype)
    out = _write(tmp_path / "ws", root / "packed", sd)
    with pytest.raises(CheckpointError) as e:
        K3Model.from_pretrained(out, dtype=torch.float32)
    assert f"{BASE}.weight_shape: {dtype} [2] holding {value}, model expects an integer [2] holding [32, 64]" \
        in str(e.value)


def test_packed_without_weight_shape_and_wrong_packed_shape(tmp_path, ckpts):
    root, model = ckpts
    sd = _shards(root / "packed")
    for k in [k for k in sd if k.endswith(".weight_shape")]:
        del sd[k]                                              # optional
    a = K3Model.from_pretrained(_write(tmp_path / "nows", root / "packed", sd), dtype=torch.float32)
    assert torch.equal(a(IDS), K3Model.from_pretrained(root / "packed", dtype=torch.float32)(IDS))
    sd[f"{BASE}.weight_packed"] = sd[f"{BASE}.weight_packed"].reshape(64, 16)   # [K, N/2]: transposed packing
    with pytest.raises(CheckpointError) as e:
        K3Model.from_pretrained(_write(tmp_path / "t", root / "packed", sd), dtype=torch.float32)
    assert f"{BASE}.weight_packed: checkpoint torch.uint8 [64, 16], model expects torch.uint8 [32, 32]" in str(e.value)


def test_k_not_a_multiple_of_the_group(tmp_path):
    # Stock k3-tiny: w2 is [32, 24]; MXFP4 of group 32 cannot hold it, in the writer or the loader.
    model = random_model(TINY, seed=2)
    key = "language_model.model.layers.1.block_sparse_moe.experts.0.w2"
    with pytest.raises(ValueError, match=f"{key}.weight: MXFP4 needs .*K a multiple of 32; got \\[32, 24\\]"):
        save_checkpoint(model, tmp_path / "no", experts_format="mxfp4-packed")
    assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match="experts_format"):
        save_checkpoint(model, tmp_path / "no", experts_format="mxfp4")
    save_checkpoint(model, tmp_path / "plain")
    sd = load_file(str(tmp_path / "plain" / "model.safetensors"))
    del sd[f"{key}.weight"]
    sd[f"{key}.blocks"] = torch.zeros(32, 1, 16, dtype=torch.uint8)
    sd[f"{key}.scales"] = torch.full((32, 1), 127, dtype=torch.uint8)
    with pytest.raises(CheckpointError) as e:
        K3Model.from_pretrained(_write(tmp_path / "k24", tmp_path / "plain", sd), dtype=torch.float32)
    assert (f"{key}.blocks: the model's matrix is [32, 24] and K = 24 is not a multiple of the MXFP4 group 32"
            in str(e.value))


def test_reference_decoder_matches_spec_table():
    # The OCP E2M1 table, written out: the test's decoder must reproduce it before it judges the loader.
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert [ref_value(c, 127) for c in range(16)] == table + [-v for v in table]
    assert math.copysign(1, ref_value(8, 127)) == -1
