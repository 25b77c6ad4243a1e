"""Does any CUDA AOTI package load here? (GPU only.) One toy package (Linear + ReLU, constants in the .so), then a
child process per import context loads and runs it: nothing else imported, CUDA initialised first, triton
imported first, k3export.plugins imported first. On the H200 (torch 2.11, 2026-11-30) every package our build
wrote segfaulted in `aoti_load_package`, this toy too when k3export.plugins was imported (scripts/aoti_bisect.py).

    python3 scripts/aoti_toy.py OUT_DIR [cuda|cpu]
"""

import subprocess
import sys
import time
from pathlib import Path

import torch

CHILD = """
import faulthandler, sys, torch
faulthandler.enable()
pkg_path, device, ctx = sys.argv[1:4]
if ctx == "cuda-init":
    torch.zeros(1, device=device)
elif ctx == "triton":
    import triton  # noqa: F401
elif ctx == "k3export":
    import k3export.plugins  # noqa: F401
pkg = torch._inductor.aoti_load_package(pkg_path)
x = torch.ones(8, 64, device=device)
y = pkg(x)
y = y[0] if isinstance(y, (list, tuple)) else y
print("ran, sum", float(y.sum()), flush=True)
"""

if __name__ == "__main__":
    out, device = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "cuda")
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).to(device).eval()
    ep = torch.export.export(model, (torch.ones(8, 64, device=device),))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(out / "toy.pt2"))
    print(f"built in {time.perf_counter() - t:.0f} s; eager sum {float(model(torch.ones(8, 64, device=device)).sum().detach())}",
          flush=True)
    for ctx in ("bare", "cuda-init", "triton", "k3export"):
        r = subprocess.run([sys.executable, "-c", CHILD, path, device, ctx], capture_output=True, text=True,
                           timeout=60)
        print(f"{ctx}: exit {r.returncode} {r.stdout.strip()} "
              f"{'' if r.returncode == 0 else r.stderr.strip().splitlines()[0][:200]}", flush=True)
