"""Config parsing/validation and checkpoints in the published layout: round trip, sharding, skipped tensors,
and errors that name every offending field or tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3export import ConfigError, K3Config, K3Model
from k3export.model.weights import CheckpointError, random_model, save_checkpoint

TINY = K3Config.from_name("k3-tiny")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ck") / "tiny"
    model = random_model(TINY, seed=11)
    save_checkpoint(model, out)
    return out, model


def test_round_trip_same_logits(ckpt):
    path, model = ckpt
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    loaded = K3Model.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(loaded(ids), model(ids))
    assert all(p.device.type == "cpu" for p in loaded.parameters())


def test_published_layout_keys(ckpt):
    path, _ = ckpt
    keys = set(load_file(str(path / "model.safetensors")))
    assert all(k.startswith("language_model.") for k in keys)
    assert "language_model.lm_head.weight" in keys
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight" in keys
    assert "language_model.model.layers.0.self_attn.q_conv1d.weight" in keys
    assert "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in keys
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in keys
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["text_config"]["linear_attn_config"]["full_attn_layers"] == [4, 8, 9]


def test_sharded_checkpoint_and_skipped_tensors(tmp_path, ckpt):
    _, model = ckpt
    out = tmp_path / "sharded"
    files = save_checkpoint(model, out, max_shard_bytes=200_000)
    assert (out / "model.safetensors.index.json").exists() and len(files) > 3
    # Vision tower, projector and MTP tensors are skipped by a text loader.
    save_file({"vision_tower.patch_embed.weight": torch.zeros(2, 2), "mm_projector.linear_1.weight": torch.zeros(2),
               "language_model.model.layers.9.eh_proj.weight": torch.zeros(2)}, str(out / "extra.safetensors"))
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    idx["weight_map"].update({"vision_tower.patch_embed.weight": "extra.safetensors"})
    (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(K3Model.from_pretrained(out, dtype=torch.float32)(ids), model(ids))


def test_longer_A_log_is_accepted(tmp_path, ckpt):
    # One reimplementation reports a 128-entry A_log in the published checkpoint; the first H entries are used.
    path, model = ckpt
    out = tmp_path / "alog"
    sd = load_file(str(path / "model.safetensors"))
    key = "language_model.model.layers.0.self_attn.A_log"
    H = TINY.linear_attn_config.num_heads
    sd[key] = torch.cat([sd[key], torch.randn(128 - H)])
    out.mkdir()
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text((path / "config.json").read_text())
    loaded = K3Model.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(loaded.model.layers[0].self_attn.A_log, model.model.layers[0].self_attn.A_log)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(ids), model(ids))


def test_load_reports_every_bad_tensor_by_name(tmp_path, ckpt):
    path, _ = ckpt
    sd = load_file(str(path / "model.safetensors"))
    del sd["language_model.model.norm.weight"]
    del sd["language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight"]
    sd["language_model.model.layers.1.self_attn.bogus.weight"] = torch.zeros(1)
    sd["language_model.lm_head.weight"] = torch.zeros(5, 64)
    out = tmp_path / "bad"
    out.mkdir()
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError) as e:
        K3Model.from_pretrained(out)
    msg = str(e.value)
    for needle in ("2 missing", "model.norm.weight", "experts.3.w1.weight", "1 unexpected", "self_attn.bogus.weight",
                   "1 mis-shaped", "lm_head.weight: checkpoint [5, 64], model expects [256, 64]"):
        assert needle in msg


def test_missing_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        K3Model.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": TINY.to_hf()}))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        K3Model.from_pretrained(tmp_path)


def test_from_hf_published_config(tmp_path):
    tc = K3Config().to_hf()
    tc.update({"architectures": ["KimiLinearForCausalLM"], "torch_dtype": "bfloat16", "bos_token_id": 1})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": tc,
                                                      "vision_config": {"hidden_size": 1152}}))
    c = K3Config.from_hf(tmp_path)
    assert c == K3Config()
    assert len(c.kda_layers) == 69 and len(c.mla_layers) == 24 and c.mla_layers[-1] == 92 and c.mla_layers[0] == 3
    assert c.latent_dim == 576 and c.num_attn_res_blocks == 8


@pytest.mark.parametrize("change,needle", [
    ({"num_experts_per_token": 9}, "num_experts_per_token: top-k (9) must be <= num_experts (8)"),
    ({"linear_attn_config": {"num_heads": 4, "head_dim": 16, "gate_lower_bound": 0.5}},
     "gate_lower_bound: must lie in (-inf, 0)"),
    ({"linear_attn_config": {"num_heads": 4, "head_dim": 16, "gate_lower_bound": float("-inf")}},
     "gate_lower_bound: must lie in (-inf, 0)"),
    ({"num_key_value_heads": 2}, "num_key_value_heads: must equal num_attention_heads"),
    ({"hidden_size": 0}, "hidden_size: must be > 0"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"linear_attn_config": {"num_heads": 4, "head_dim": 16, "kda_layers": [1, 2], "full_attn_layers": [4]}},
     "must cover layers 1..9"),
    ({"num_hidden_layerz": 9}, "unknown config field 'num_hidden_layerz'; did you mean 'num_hidden_layers'?"),
    ({"linear_attn_config": {"num_headz": 4}}, "unknown config field 'linear_attn_config.num_headz'"),
])
def test_config_errors_name_field_and_constraint(change, needle):
    d = TINY.to_hf()
    d["linear_attn_config"] = {"num_heads": 4, "head_dim": 16}           # let the schedule be derived
    d.update(change)
    with pytest.raises(ConfigError) as e:
        K3Config.from_dict(d)
    assert needle in str(e.value)


def test_unknown_fields_ignored_when_not_strict():
    d = TINY.to_hf()
    d["some_future_field"] = 1
    assert K3Config.from_dict(d, strict=False) == TINY


def test_tp_that_does_not_divide_heads():
    from k3export.shapes import shape_data
    with pytest.raises(ConfigError, match="num_heads: 4 does not divide by --tp 3"):
        shape_data(TINY, tokens=2, tp=3)


def test_quantized_experts_get_a_specific_error(tmp_path, ckpt):
    path, _ = ckpt
    sd = load_file(str(path / "model.safetensors"))
    key = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"
    del sd[key]
    sd[key + "_packed"] = torch.zeros(24, 4, dtype=torch.uint8)
    sd[key + "_scale"] = torch.ones(24, 1)
    out = tmp_path / "q"
    out.mkdir()
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="stored quantized .*MXFP4.*dequantize") as e:
        K3Model.from_pretrained(out)
    assert "1 missing" in str(e.value) and key in str(e.value)


def test_written_artifacts_follow_the_umask(tmp_path):
    """Checkpoints (and every safetensors file the tool writes: engine weights, scales) get the modes a plain
    open()/mkdir() would: safetensors' save_file alone makes 0600 files and mkdtemp a 0700 directory, which a
    serving process running as another user could not read."""
    import os
    import stat
    from k3export.manifest import save_tensors
    old = os.umask(0o022)
    try:
        out = tmp_path / "ckpt"
        save_checkpoint(random_model(K3Config.from_name("k3-tiny"), seed=0), out)
        save_tensors({"a": torch.zeros(2)}, tmp_path / "scales.safetensors")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)
    assert mode(out) == 0o755 and mode(tmp_path / "scales.safetensors") == 0o644
    assert {f.name: mode(f) for f in out.iterdir()} == {"config.json": 0o644, "model.safetensors": 0o644}
