"""Exported graphs on the GPU: graphs exported on cuda re-load from disk and run with every k3 op on its Triton
kernel, equal to the eager model (same kernels) and as close to the float32 naive twins as bf16 allows.

The full `k3-small` run is `bash scripts/gpu.sh e2e` (export + verify, ~3 min); this test cuts k3-small to its
first 4 layers (3 KDA + 1 MLA, dense layer 0, K3's head dims) to keep the GPU suite short."""

import dataclasses

import pytest
import torch

from k3export.config import K3Config
from k3export.export import ExportLimits, export_graphs
from k3export.manifest import preset_fingerprint
from k3export.model.weights import random_model
from k3export.verify import verify

pytestmark = pytest.mark.cuda


def small4() -> K3Config:
    c = K3Config.from_name("k3-small")
    lac = dataclasses.replace(c.linear_attn_config, kda_layers=(), full_attn_layers=())
    return dataclasses.replace(c, num_hidden_layers=4, linear_attn_config=lac)


def test_cuda_graphs_run_the_triton_kernels_and_match(tmp_path):
    model = random_model(small4(), seed=0, dtype=torch.bfloat16, device="cuda")
    source = {"weights": preset_fingerprint("k3-small-4", 0, torch.bfloat16), "preset": "k3-small-4", "seed": 0}
    man = export_graphs(model, tmp_path, ExportLimits(max_batch=4, max_tokens=512, max_cache=2048), source,
                        log=print)
    assert man["device"] == "cuda"
    del model
    ok, table = verify(tmp_path, run_onnx=False)
    print(table)
    registered = table.split("kernels registered for: ")[1].split(";")[0].split(", ")
    for op in ("k3::kda_decode", "k3::kda_prefill", "k3::mla_decode", "k3::mla_prefill", "k3::moe_routed"):
        assert op in registered, (op, registered)          # the graphs' ops (the serving-only ones may follow)
    assert ok, table
