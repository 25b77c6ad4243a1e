"""Offline sm_90 build report of the MoE prefill GEMMs, no GPU needed: registers, spill stack, shared memory and
matrix instructions (wgmma / mma.sync) of gemm1 (also "gemm1p": gate/up rows paired, `interleave_gate_up`) and
gemm2 for every tiling in `kernels.TILINGS["prefill"]`.

    python scripts/moe_tiles_sm90.py [tiling ...]

Uses whatever triton is importable; the H200 image has 3.6.0, so for its numbers unpack that wheel
(`pip download triton==3.6.0 --no-deps`, unzip into a folder) and put the folder first on PYTHONPATH. Signatures as
the launchers pass them for bf16 at K3 size (TMA descriptors where the tiling uses them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3export.plugins.moe import kernels as K

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _desc(rows, cols):
    return f"tensordesc<bf16[{rows},{cols}]>"


def signature(which: str, cfg, paired: bool = False) -> tuple[dict, dict]:
    bn, bk = (cfg.gemm1 if which == "gemm1" else cfg.gemm2)[:2]
    aw, wd = cfg.tma == "aw", bool(cfg.tma)
    a = _desc(cfg.block_m, bk) if aw else "*bf16"
    w = _desc(2 * bn if paired else bn, bk) if wd else "*bf16"
    ints = dict(MB="i32", L="i32", I="i32")
    if which == "gemm1":
        sig = dict(a=a, w1=w, w3=w, h="*bf16", row_pair="*i32", block_expert="*i32", **ints, stride_an="i32",
                   stride_we="i32", stride_wi="i32", stride_hm="i32", group_m="i32", beta="fp32", linear_beta="fp32",
                   TOP_K="constexpr")
        cx = dict(TOP_K=16)
    else:
        sig = dict(h=a, w2=w, y="*fp32", row_pair="*i32", block_expert="*i32", **ints, stride_hm="i32",
                   stride_we="i32", stride_wl="i32", stride_yp="i32", group_m="i32")
        cx = {}
    sig.update({k: "constexpr" for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "A_DESC", "W_DESC", "DOT_PREC", "TAIL")})
    cx.update(BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk, A_DESC=aw, W_DESC=wd, DOT_PREC="tf32", TAIL=cfg.tail)
    sig["a_tail"] = _desc(cfg.tail, bk) if aw and cfg.tail else "constexpr"
    if not (aw and cfg.tail):
        cx["a_tail"] = None
    if paired:                                       # gate/up rows interleaved: one [2 BN, BK] weight tile per step
        sig["PAIRED"], cx["PAIRED"] = "constexpr", True
    if which == "gemm1" and cfg.fast_act:            # the epilogue's math (`_situ_glu` FAST)
        sig["FAST_ACT"], cx["FAST_ACT"] = "constexpr", cfg.fast_act
    return sig, cx


def report(name: str, cfg) -> None:
    builds = [("gemm1", False), ("gemm1", True), ("gemm2", False)] if cfg.tma else [("gemm1", False), ("gemm2", False)]
    for which, paired in builds:
        fn = K.moe_gemm1_fwd_kernel if which == "gemm1" else K.moe_gemm2_fwd_kernel
        warps, stages = (cfg.gemm1 if which == "gemm1" else cfg.gemm2)[2:]
        sig, cx = signature(which, cfg, paired)
        c = triton.compile(ASTSource(fn, sig, cx), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=stages))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"])
            f.flush()
            usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                                   text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        ptx = c.asm["ptx"]
        which = "gemm1p" if paired else which + " "
        print(f"{name:18s} {which} regs {m.group(1):>3s}  spill stack {m.group(2):>4s} B  shared "
              f"{c.metadata.shared:>6d} B  wgmma {ptx.count('wgmma.mma_async'):2d}  mma.sync {ptx.count('mma.sync'):2d}")


if __name__ == "__main__":
    print(f"triton {triton.__version__}, sm_90")
    for name in sys.argv[1:] or K.TILINGS["prefill"]:
        report(name, K.TILINGS["prefill"][name])
