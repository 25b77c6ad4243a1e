import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tests run tiny shapes, which gain nothing from intra-op threads, and on a busy 2-core machine two
    OpenMP threads spin-wait (measured: a k3-tiny decode step 19 ms with one thread, 160 ms with two under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; run `make test-gpu` on the GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _interpreter_run(script: str) -> str:
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def interp(request, tmp_path_factory):
    """Results of the requesting test module run as a script under the Triton interpreter. `triton.jit` (and
    triton's own library functions) pick the interpreter when triton is first imported, so the CPU kernel cases
    run in a fresh process with TRITON_INTERPRET=1 set before that import; the script prints one JSON dict of
    relative errors as its last line. Under pytest-xdist one module's tests can run on both workers (the collection
    is cut in halves and workers steal each other's tests; measured: the MLA module's script ran on both), so the
    first worker to need a module's results runs its script and keeps the line in the session's shared temporary
    directory, under a lock: the other worker reads it there (or waits for it) instead of running it again."""
    script = request.module.__file__
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return json.loads(_interpreter_run(script))
    from filelock import FileLock
    shared = tmp_path_factory.getbasetemp().parent / f"interp-{Path(script).stem}.json"
    with FileLock(f"{shared}.lock"):
        if not shared.exists():
            shared.write_text(_interpreter_run(script))
        return json.loads(shared.read_text())


@pytest.fixture(scope="module")
def tiny_mla8():
    """k3-tiny with KDA heads of 128 and 8 MLA heads (the persistent kernel's shapes: chain.cu's attention takes
    heads 8 a tile), bf16, random weights (one per test module: the megakernel backend unpacks the model)."""
    import dataclasses
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    base = K3Config.from_name("k3-tiny")
    cfg = dataclasses.replace(base, linear_attn_config=dataclasses.replace(base.linear_attn_config, num_heads=2,
                                                                           head_dim=128),
                              num_attention_heads=8, num_key_value_heads=8)
    return cfg, random_model(cfg, seed=0, dtype=torch.bfloat16)
