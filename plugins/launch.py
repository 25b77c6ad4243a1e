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
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_traced = False


def launch(kernel):
    """`kernel`, or its traceable `wrap_triton` form inside `traced_launches()`; index with the grid."""
    return _Traceable(kernel) if _traced else kernel


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
