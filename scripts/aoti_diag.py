"""Where does an AOTI engine crash on CUDA? (GPU only; `make demo --device cuda` segfaulted at its run step on
2026-11-30 and the kernels-compiled-in test's loader failed, both with no Python error.)

Builds two CUDA aoti engines concurrently: k3-tiny fp32 with the k3 ops as extern calls (what the demo builds)
and k3-small cut to 4 layers, bf16, with the Triton kernels compiled in (K3EXPORT_AOTI_KERNELS=1, what
tests/test_aoti_cuda.py builds). Then loads and runs each in a child process under each loader option
(user_managed constants or copied, single-threaded runner or not), with faulthandler on, printing each step as
it completes, so a segfault names the step; a child that finishes compares its outputs with eager's.

    python3 scripts/aoti_diag.py OUT_DIR [cuda|cpu]      (cpu: a dry run of this script on k3-tiny)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CHILD = textwrap.dedent("""
    import faulthandler, sys, torch
    faulthandler.enable()
    from safetensors.torch import load_file
    engine, work, prefix, extern, user_managed, single, device = sys.argv[1:8]
    step = lambda s: print("step:", s, flush=True)
    if extern == "1":
        import k3export.plugins
        from k3export.runtime import load_kernels
        load_kernels(device)
        step("k3 ops registered")
    weights = load_file(f"{engine}/weights.safetensors", device=device)
    inputs = torch.load(f"{work}/inputs.pt")
    out = {}
    for g in ("prefill", "decode"):
        pkg = torch._inductor.aoti_load_package(f"{engine}/{g}.aoti.pt2", run_single_threaded=single == "1")
        step(f"{g}: package loaded")
        fqns = pkg.get_constant_fqns()
        pkg.load_constants({f: weights[f.removeprefix(prefix)] for f in fqns}, check_full_update=True,
                           user_managed=user_managed == "1")
        step(f"{g}: {len(fqns)} constants loaded")
        res = pkg(*[x.to(device) for x in inputs[g]])
        if device == "cuda":
            torch.cuda.synchronize()
        step(f"{g}: ran")
        out[g] = [t.cpu() for t in res]
    torch.save(out, f"{work}/out-{user_managed}{single}.pt")
    step("done")
""")


CASES = {"tiny-fp32-extern": ("k3-tiny", torch.float32, False),
         "small4-bf16-kernels": ("k3-small-4", torch.bfloat16, True)}


def model_of(name: str, device: str):
    from k3export.config import K3Config
    from k3export.model.weights import random_model
    from test_gpu_graphs import small4
    preset, dtype, _ = CASES[name]
    cfg = small4() if preset == "k3-small-4" else K3Config.from_name(preset)
    return random_model(cfg, seed=0, dtype=dtype, device=device)


def build_one(name: str, out: Path, device: str) -> None:
    """Child process: build one engine (its own process, so K3EXPORT_AOTI_KERNELS reaches its workers)."""
    from k3export.build import build, profiles_for
    t = time.perf_counter()
    path = build("aoti", model_of(name, device), out / name,
                 profiles=profiles_for(max_batch=4, max_tokens=128, max_len=256),
                 echo=lambda s: print(f"[{name}] {s}", flush=True))
    (out / f"{name}.path").write_text(str(path))
    print(f"[{name}] built in {time.perf_counter() - t:.0f} s: {path}", flush=True)


def main() -> None:
    from k3export.export import example_inputs, io_specs

    if sys.argv[1] == "--build":
        build_one(sys.argv[2], Path(sys.argv[3]), sys.argv[4])
        return
    out, device = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "cuda")
    out.mkdir(parents=True, exist_ok=True)
    names = list(CASES) if device == "cuda" else ["tiny-fp32-extern"]      # cpu: a dry run of this script
    procs = {n: subprocess.Popen([sys.executable, __file__, "--build", n, str(out), device],
                                 env={**os.environ, "K3EXPORT_AOTI_KERNELS": "1" if CASES[n][2] else "0"})
             for n in names}
    paths = {n: Path((out / f"{n}.path").read_text()) for n, p in procs.items() if p.wait() == 0}
    print("built:", paths, flush=True)

    for name, path in paths.items():
        model = model_of(name, device)
        cfg, dtype = model.config, CASES[name][1]
        m = json.loads((path / "manifest.json").read_text())
        extern = m["aoti"]["extern_ops"]
        print(f"[{name}] extern ops: {extern}; kernels: "
              f"{ {g: r['compiled_in'] for g, r in m['aoti']['kernels'].items()} }", flush=True)
        work = out / f"{name}-work"
        work.mkdir(exist_ok=True)
        specs = io_specs(cfg, dtype)
        sizes = {"prefill": {"batch": 2, "tokens": 100, "past": 40}, "decode": {"batch": 3, "cache": 200}}
        inputs = {g: list(example_inputs(specs[g]["inputs"], sizes[g], vocab=cfg.vocab_size, seed=3,
                                         device=device).values()) for g in sizes}
        with torch.no_grad():
            eager = {"prefill": model.forward_prefill(*inputs["prefill"]),
                     "decode": model.forward_decode(*inputs["decode"])}
        torch.save({g: [x.cpu() for x in v] for g, v in inputs.items()}, work / "inputs.pt")
        for um, single in (("1", "1"), ("0", "1"), ("1", "0"), ("0", "0")):
            tag = f"user_managed={um} single_threaded={single}"
            r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(work), m["aoti"]["constant_prefix"],
                                "1" if extern else "0", um, single, device], capture_output=True, text=True,
                               timeout=240)
            steps = [ln for ln in r.stdout.splitlines() if ln.startswith("step:")]
            print(f"[{name}] {tag}: exit {r.returncode}; {steps[-1] if steps else 'no step'}", flush=True)
            if r.returncode:
                print(textwrap.indent(r.stderr[-2500:], "    "), flush=True)
                continue
            got = torch.load(work / f"out-{um}{single}.pt")
            for g in ("prefill", "decode"):
                worst = max(((a.double() - e.cpu().double()).abs().max() / e.abs().max().clamp_min(1e-30)).item()
                            for a, e in zip(got[g], eager[g]))
                print(f"    {g}: worst max-abs / max|eager| over outputs {worst:.2e} (prefill includes padded "
                      "rows)", flush=True)


if __name__ == "__main__":
    main()
