"""Bisect the AOTI-on-CUDA segfault (GPU only). On the H200 (torch 2.11, 2026-11-30) every CUDA package our build
wrote segfaulted inside `aoti_load_package` (the AOTIModelPackageLoader constructor), whatever the loader options
(scripts/aoti_diag.py, since removed: git history). The CPU packages load and run. This builds, in parallel, CUDA
packages that differ in one thing each, then loads and runs each in a child process; a child that crashes is re-run
under cuda-gdb for the native backtrace:

  toy-so / toy-noso          a Linear + ReLU, constants in the .so / loaded afterwards (our build's setting)
  toy-op-noso                the same plus an extern k3 op call (k3::attn_res) through the proxy executor
  tiny-decode-so / -noso     k3-tiny's exported decode graph (fp32, extern k3 ops), constants in / out of the .so

    python3 scripts/aoti_bisect.py OUT_DIR [cuda|cpu]      (cpu: a dry run of this script)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

CASES = ("toy-so", "toy-noso", "toy-op-noso", "tiny-decode-so", "tiny-decode-noso")


class Toy(torch.nn.Module):
    def __init__(self, op: bool):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.norm = torch.nn.Parameter(torch.rand(64) + 0.5)
        self.proj = torch.nn.Parameter(torch.randn(64) * 0.1)
        self.op = op

    def forward(self, x):                                    # x [N, 64]
        h = torch.relu(self.lin(x))
        if self.op:
            bank = torch.stack([x, h], 1)                    # [N, 2, 64]
            h = torch.ops.k3.attn_res(bank, h, self.norm, self.proj, 1e-6)
        return (h,)


def build(case: str, out: Path, device: str) -> None:
    """Child: build one package into out/case.pt2 and save its inputs, constants and eager outputs."""
    import k3export.plugins  # noqa: F401 (registers the k3 ops)
    torch.manual_seed(0)
    in_so = case.endswith("-so")
    if case.startswith("toy"):
        model = Toy(op="-op" in case).to(device).eval()
        args = (torch.randn(8, 64, device=device),)
        ep = torch.export.export(model, args)
        consts = {k: v for k, v in model.state_dict().items()}
    else:
        from k3export.config import K3Config
        from k3export.export import ExportLimits, export_graphs
        from k3export.model.weights import random_model
        from k3export.runtime import load_kernels
        load_kernels(device)
        model = random_model(K3Config.from_name("k3-tiny"), seed=0, dtype=torch.float32, device=device)
        d = out / f"{case}-export"
        export_graphs(model, d, ExportLimits(max_batch=4, max_tokens=128, max_cache=256), {"preset": "k3-tiny"},
                      log=lambda *a: None)
        ep = torch.export.load(str(d / "decode.pt2"))
        args = tuple(a.to(device) for a in ep.example_inputs[0]) if ep.example_inputs else None
        if args is None:
            from k3export.export import EXAMPLE, example_inputs, io_specs
            args = tuple(example_inputs(io_specs(model.config, model.dtype)["decode"]["inputs"], EXAMPLE,
                                        device=device, vocab=model.config.vocab_size).values())
        consts = {k: v for k, v in ep.state_dict.items()}
    with torch.no_grad():
        ref = ep.module()(*args)
    t = time.perf_counter()
    torch._inductor.aoti_compile_and_package(ep, package_path=str(out / f"{case}.pt2"),
                                             inductor_configs={"aot_inductor.package_constants_in_so": in_so})
    torch.save({"args": [a.cpu() for a in args], "consts": {k: v.cpu() for k, v in consts.items()},
                "ref": [r.cpu() for r in ref]}, out / f"{case}.data")
    print(f"{case}: built in {time.perf_counter() - t:.0f} s", flush=True)


LOAD = textwrap.dedent("""
    import faulthandler, sys, torch
    faulthandler.enable()
    case, out, device, imports = sys.argv[1:5]
    if imports == "k3":                  # else load without importing k3export (its extern ops then fail to run)
        import k3export.plugins
    step = lambda s: print("step:", s, flush=True)
    data = torch.load(f"{out}/{case}.data")
    step("data read")
    pkg = torch._inductor.aoti_load_package(f"{out}/{case}.pt2")
    step("package loaded")
    if not case.endswith("-so"):
        fqns = pkg.get_constant_fqns()
        pkg.load_constants({f: data["consts"][f].to(device) for f in fqns}, check_full_update=True)
        step(f"{len(fqns)} constants loaded")
    res = pkg(*[a.to(device) for a in data["args"]])
    step("ran")
    err = max(((r.cpu().double() - e.double()).abs().max() / e.double().abs().max().clamp_min(1e-30)).item()
              for r, e in zip(res, data["ref"]))
    step(f"max-abs / max|ref| {err:.2e}")
""")


def main() -> None:
    if sys.argv[1] == "--build":
        build(sys.argv[2], Path(sys.argv[3]), sys.argv[4])
        return
    out, device = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "cuda")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    procs = {c: subprocess.Popen([sys.executable, __file__, "--build", c, str(out), device],
                                 stdout=open(out / f"{c}.build.log", "w"), stderr=subprocess.STDOUT) for c in CASES}
    for c, p in procs.items():
        rc = p.wait()
        print(f"{c}: build exit {rc} at {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            print(textwrap.indent((out / f"{c}.build.log").read_text()[-1500:], "    "), flush=True)
    gdb = shutil.which("cuda-gdb")
    traced = False
    for c, imports in [(c, i) for c in CASES for i in ("k3", "bare")]:
        if not (out / f"{c}.data").exists():
            continue
        r = subprocess.run([sys.executable, "-c", LOAD, c, str(out), device, imports], capture_output=True,
                           text=True, timeout=120)
        steps = [ln.removeprefix("step: ") for ln in r.stdout.splitlines() if ln.startswith("step:")]
        print(f"{c} ({imports}): load exit {r.returncode}; steps: {' | '.join(steps)}", flush=True)
        if r.returncode and imports == "bare":
            print("    " + r.stderr.strip().splitlines()[-1][:300] if r.stderr.strip() else "", flush=True)
        if r.returncode and imports == "k3" and not traced:        # one native backtrace is enough
            traced = True
            print(textwrap.indent(r.stderr[-1200:], "    "), flush=True)
            if gdb:
                g = subprocess.run([gdb, "-batch", "-ex", "run", "-ex", "bt 30", "--args", sys.executable, "-c",
                                    LOAD, c, str(out), device, imports], capture_output=True, text=True, timeout=180,
                                   env={**os.environ, "PYTHONFAULTHANDLER": "0"})
                bt = [ln for ln in g.stdout.splitlines() if ln.startswith("#") or "SIG" in ln]
                print(textwrap.indent("\n".join(bt[:40]) or g.stdout[-1500:], "    gdb: "), flush=True)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
