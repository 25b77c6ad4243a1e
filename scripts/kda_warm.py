"""Compile the KDA prefill kernels ahead of `bench kda --sweep` and the `cuda` tests (scripts/gpu_kda.sh), one
process per variant in parallel: Triton's on-disk cache is shared, so the sweep and the tests then find every
kernel compiled and the device call spends its time measuring. Each variant is then run once at the sweep's shape
(B=1, T=8192, H=96) and checked against the eager reference in the same process, its result written to
`$KDA_CHECK_DIR/<name>.json` (default /tmp/kda_checks): a variant that faults (an illegal memory access ends the
CUDA context) takes down only its own process, and `bench kda --sweep --checked DIR` times only the variants whose
check passed.

A kernel's compile is keyed by its constexprs and its integer arguments' divisibility by 16, not by sizes: a
tiny call (B=1, T=64 or 40) compiles what T=8192 (or 3000) uses at the same H. `python3 scripts/kda_warm.py --list`
prints the job names, one a line; `python3 scripts/kda_warm.py NAME...` runs them.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch

from k3export.bench.kda import INTRA_VARIANTS, STATE_VARIANTS
from k3export.plugins.kda import kernels

# (H, T): the sweep's H with T % 16 == 0 for every variant; the defaults also at the cuda tests' other H and
# T % 16 != 0 (test_prefill_k3_shapes, strong decay, the fla naive comparison). The intra variants at the tests'
# shapes too: scripts/gpu_kda.sh runs the prefill cuda tests with the fastest non-default one.
VARIANT_SHAPES = [(96, 64)]
DEFAULT_SHAPES = [(96, 64), (96, 40), (12, 64), (12, 40)]


def jobs() -> dict:
    """name -> (config overrides, [(H, T)]); variants equal to the default are compiled by the default's jobs."""
    default = kernels.prefill_config(128, 128)
    out = {f"default H{H} T{T}": ({}, [(H, T)]) for H, T in DEFAULT_SHAPES}
    out.update({n: (c, DEFAULT_SHAPES) for n, c in INTRA_VARIANTS.items() if {**default, **c} != default})
    out.update({n: (c, VARIANT_SHAPES) for n, c in STATE_VARIANTS.items() if {**default, **c} != default})
    return out


def check_name(name: str) -> str:
    """File stem of a variant's check result."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name)


def _compile(cfg: dict, H: int, T: int) -> None:
    r = lambda *s: torch.randn(*s, device="cuda")
    q, k, v, f = (r(1, T, H, 128).bfloat16() for _ in range(4))
    args = (q, k, v, f, r(1, T, H).bfloat16(), r(H), r(H * 128), r(1, H, 128, 128),
            torch.tensor([T], device="cuda"), -5.0)
    kernels.kda_prefill_fwd(*args, config=cfg)
    torch.cuda.synchronize()


def run(name: str) -> None:
    """Compile `name` at its first shape, check it at the sweep's shape (variants), then compile the others."""
    cfg, shapes = jobs()[name]
    _compile(cfg, *shapes[0])
    print("compiled", name, shapes[0], flush=True)
    if not name.startswith("default"):
        from k3export.bench.kda import PREFILL_BOUND, _prefill_args, _rel
        from k3export.plugins.kda.op import kda_prefill
        args = _prefill_args(8192, 96)
        o, S = kernels.kda_prefill_fwd(*args, config=cfg)
        o_ref, S_ref = kda_prefill._init_fn(*args)
        err = {"o": _rel(o, o_ref), "state": _rel(S, S_ref)}
        err["ok"] = all(err[n] < PREFILL_BOUND[n] for n in ("o", "state"))
        out = Path(os.environ.get("KDA_CHECK_DIR", "/tmp/kda_checks"))
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{check_name(name)}.json").write_text(json.dumps(err))
        print("checked", name, err, flush=True)
    for H, T in shapes[1:]:
        _compile(cfg, H, T)
        print("compiled", name, (H, T), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--list"]:
        print("\n".join(jobs()))
    else:
        for n in sys.argv[1:]:
            run(n)
