"""How the host launchers (`<op>/kernels.py`) start their Triton kernels, and how they size launches on symbolic
shapes.

Eager calls launch a kernel directly: `launch(kernel)[grid](...)` is `kernel[grid](...)`. While
`traced_launches()` is active (the AOTInductor lowering in `k3export.aoti_lower` traces a launcher on fake
tensors), `launch` returns `torch.library.wrap_triton(kernel)` instead, so the launch becomes a
`triton_kernel_wrapper` node that Inductor compiles into its package. `wrap_triton` is not used in eager: its
higher-order-op dispatch costs host time on every call.

A traced launcher sees symbolic sizes (batch, tokens, cache rows). Grids and kernel arguments may be symbolic;
block sizes (constexprs) and tile choices may not. `size_bound(n)` is n for an int and the largest value a
symbolic n can take (its export range) otherwise: a tile chosen from it is the tile the eager launcher picks at
the largest shape, and the kernels mask every tile, so it is correct at every smaller shape.

Programmatic dependent launch (PDL; off by default here, on in the `compile` serving backend on sm_90+, which runs
its decode calls inside `pdl(True)`): with env `K3_PDL=1` (read here, once, at import) or inside `pdl(True)`,
`pdl_args(t)` gives the decode-path launchers `PDL=True, launch_pdl=True` for tensors on a CUDA device of compute
capability >= 9 (the MoE decode kernels only with `pdl(True, moe=True)` or env `K3_MOE_PDL=1`: not yet timed).
The kernel is then launched with the programmatic-stream-serialization attribute (it may start while its
predecessor in the stream finishes) and, by its `PDL` constexpr, executes
`griddepcontrol.wait` (`gdc_wait`) as its very first instruction, then `griddepcontrol.launch_dependents`: so none
of its loads or stores (in-place state, reused workspaces, ticket counters) runs before the predecessor has
completed and flushed its writes; what overlaps is the launch, the block scheduling and the predecessor's tail.
Off (or CPU, the interpreter, a traced launch): `pdl_args` is {} and the kernels compile as before (PDL defaults
to False: the same PTX). The switch is read at launch time, so it must be on while a CUDA graph is captured:
capture records such a launch as a programmatic graph edge (CUDA >= 12.3 graph edge data; CUDA Programming Guide
4.2 "CUDA Graphs" and 4.5 "Programmatic Dependent Launch and Synchronization"). A successor launched without the
attribute (cuBLAS; Inductor's kernels: `CompileBackend` refuses its `triton.enable_pdl`) waits for full completion
as before, whatever this kernel signals. Since the signal comes after the wait, a kernel that starts on it also
starts after every earlier launch of the stream has completed. The one exception, `plugins.gemv`, signals first
and loads its weights before its wait (nothing in a decode step writes a weight); everything else it touches comes
after the wait, so completion stays transitive along the stream. Inside `pdl(early=True)` (the `compile` backend's
default) every decode kernel signals first (`EARLY`): a successor may then start before older grids have
completed, which is safe because each of our kernels touches nothing a predecessor writes before its own wait.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"     # the Triton interpreter at import (CPU): no inline PTX
_traced = False
_pdl = os.environ.get("K3_PDL", "0") == "1"
_pdl_moe = os.environ.get("K3_MOE_PDL", "0") == "1"
_pdl_early = False
_pdl_capable: dict[int, bool] = {}     # device index -> compute capability >= 9 (queried once per device)


def launch(kernel):
    """`kernel`, or its traceable `wrap_triton` form inside `traced_launches()`; index with the grid. A diagnostic:
    with env K3_TWICE naming the kernel (comma-separated function names, read at each launch, so at CUDA-graph
    capture), every launch runs twice in a row, same arguments (`scripts/ab_decode.py --env K3_TWICE=,name`: what
    one more kernel of that kind costs the decode step; a kernel that updates state in place then updates it
    twice, so only the timing means anything)."""
    if _traced:
        return _Traceable(kernel)
    twice = os.environ.get("K3_TWICE")
    if twice and getattr(kernel, "fn", kernel).__name__ in twice.split(","):
        return _Twice(kernel)
    return kernel


class _Twice:
    """`kernel[grid](...)` launched twice (K3_TWICE)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def call(*args, **kwargs):
            run(*args, **kwargs)
            return run(*args, **kwargs)

        return call


class _Traceable:
    """`kernel[grid](...)` as a `wrap_triton` launch. Parameters left at their defaults are passed explicitly:
    torch's analysis of a wrapped kernel (which arguments it writes) expects a value for every parameter. A
    `maxnreg` register cap is dropped: torch takes num_warps / num_stages (and a few more) as launch options, not
    maxnreg, which would reach the kernel as an unknown argument. Only the speed changes (KDA decode)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        wrapped = torch.library.wrap_triton(self.kernel)[grid]

        def call(*args, **kwargs):
            kwargs.pop("maxnreg", None)
            for p in self.kernel.params[len(args):]:
                if p.name not in kwargs and p.has_default:
                    kwargs[p.name] = p.default
            return wrapped(*args, **kwargs)

        return call


def traced() -> bool:
    """Inside `traced_launches()` (an AOTI lowering trace): host-built TMA descriptors are not available there."""
    return _traced


@contextmanager
def traced_launches():
    """Launch through `wrap_triton` (for tracing with make_fx / run_decompositions) inside this block."""
    global _traced
    prev, _traced = _traced, True
    try:
        yield
    finally:
        _traced = prev


def size_bound(n) -> int:
    """n for an int; for a symbolic size, its upper bound from the shape environment (ValueError if unbounded)."""
    if isinstance(n, int):
        return n
    if not isinstance(n, torch.SymInt):
        raise TypeError(f"size_bound: expected an int or SymInt, got {type(n).__name__}")
    node = n.node
    hi = node.shape_env.bound_sympy(node.expr).upper
    if not hi.is_finite:
        raise ValueError(f"size_bound: the symbolic size {node.expr} has no upper bound; export it with a max")
    return int(hi)


@contextmanager
def pdl(on: bool = True, moe: bool | None = None, early: bool | None = None):
    """Launch the decode kernels with programmatic dependent launch (`on`) or without, inside this block; `moe`
    (None: as it was) the MoE decode kernels too; `early` (None: as it was) with the dependents' launch signalled
    before the wait (`EARLY`). Only for streams whose PDL-launched kernels all wait before touching anything a
    predecessor writes (ours do; the GEMV's pre-wait loads are weights): a successor launched on an early signal
    may start before the grids two launches back have completed, so a kernel that loads activations before its
    wait (Inductor's own kernels under its `triton.enable_pdl`, which `CompileBackend` refuses) must not follow
    one."""
    global _pdl, _pdl_moe, _pdl_early
    prev = _pdl, _pdl_moe, _pdl_early
    _pdl = bool(on)
    _pdl_moe = _pdl_moe if moe is None else bool(moe)
    _pdl_early = _pdl_early if early is None else bool(early)
    try:
        yield
    finally:
        _pdl, _pdl_moe, _pdl_early = prev


def pdl_capable(device: torch.device) -> bool:
    """Whether CUDA device `device` has programmatic dependent launch (compute capability >= 9; queried once)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _pdl_capable.get(idx)
    if ok is None:
        ok = _pdl_capable[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return ok


def pdl_args(t: torch.Tensor, moe: bool = False) -> dict:
    """`{"PDL": True, "launch_pdl": True}` for a kernel launched on t's device when the PDL switch is on (for a MoE
    kernel, `moe`, its MoE switch too), t is on a CUDA device of compute capability >= 9 and the launch is eager
    (not traced, not the interpreter); else {} (the kernel's `PDL` constexpr stays at its default False:
    unchanged PTX, plain launch)."""
    if not _pdl or (moe and not _pdl_moe) or _traced or t.device.type != "cuda" \
            or os.environ.get("TRITON_INTERPRET") == "1":
        return {}
    if not pdl_capable(t.device):
        return {}
    env = os.environ.get("K3_PDL_EARLY")                  # read at each launch: an A/B switch over `pdl(early=)`
    early = _pdl_early if env is None else env == "1"
    return {"PDL": EARLY if early else True, "launch_pdl": True}


EARLY = 2      # the PDL constexpr's value for "signal the dependents' launch before the wait"


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """The kernel side of `pdl_args`, called first thing in a kernel: with PDL, wait for the stream predecessor to
    complete (its writes visible), then let the next PDL launch start its launch. With PDL == EARLY
    (`pdl(early=True)`; env K3_PDL_EARLY=1 / 0 forces it at each launch) the signal comes first, so the next kernel
    is launched (and a GEMV streams its weights) while this one still waits: `griddepcontrol.wait` still waits for
    the predecessor grid's completion, but what a successor does before its own wait is no longer ordered after
    the grids before this one (see `pdl`). Without PDL, nothing."""
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()
