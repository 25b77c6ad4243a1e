"""Ahead-of-time launch contracts for Triton kernels: what a TensorRT AOT plugin (or any driver-level caller) needs
to run a kernel with no Python: its PTX, entry name, grid, block, dynamic shared memory and parameter order.

A `Launch` is plain data, computed without TensorRT. `launch_cupy` runs one through the CUDA driver (cupy
`RawModule`), which is how the contracts are tested against the torch ops on the GPU machine.

Parameter order is the kernel's own (ours are written inputs..., scalars..., outputs..., as TensorRT's AOT
plugins require). Triton appends hidden pointer parameters (global / profile scratch) after them; the contract
records how many, and a caller passes null for each (`compile_ptx` refuses kernels that need scratch memory).
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from dataclasses import dataclass, field

import torch

TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8",
                torch.float8_e4m3fn: "fp8e4nv"}


def pointer_type(dtype: torch.dtype) -> str:
    """Triton signature string of a pointer to `dtype`, e.g. `*bf16`."""
    return "*" + TRITON_TYPES[dtype]


@dataclass(frozen=True)
class CompiledKernel:
    name: str            # PTX entry name
    ptx: str
    shared_mem: int      # dynamic shared memory bytes
    num_warps: int
    hidden_params: int   # trailing pointer params Triton adds (pass null)


@dataclass(frozen=True)
class Launch:
    """One kernel launch. `params` is the kernel's parameter order as (name, triton type) pairs, constexprs
    excluded; `scalars` gives the value of every non-pointer param for these shapes."""

    kernel: CompiledKernel
    grid: tuple[int, int, int]
    params: tuple[tuple[str, str], ...]
    scalars: dict = field(default_factory=dict)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.kernel.num_warps * 32, 1, 1)


def compile_ptx(fn, signature: dict[str, str], constexprs: dict, num_warps: int, num_stages: int = 1,
                arch: int = 90, maxnreg: int | None = None) -> CompiledKernel:
    """Compile a `@triton.jit` kernel to PTX for sm_`arch` (no GPU needed: Triton ships ptxas).

    signature: every parameter of `fn` in order, `"*bf16"`-style for pointers, `"i32"`/`"fp32"` for scalars,
    `"constexpr"` for compile-time constants, whose values come in `constexprs`. Pointers are assumed 16-byte
    aligned (TensorRT and torch allocations are). `maxnreg` caps registers per thread (a `.maxnreg` directive in
    the PTX, so whoever JIT-compiles it keeps the cap), as the torch launcher's `maxnreg` launch option does.
    A constexpr parameter with a default that `signature` leaves out compiles at its default (e.g. `PDL`).
    """
    missing = {p.name: p.default for p in fn.params if p.name not in signature and p.is_constexpr and p.has_default}
    if missing:
        signature = {n: "constexpr" if n in missing else signature[n] for n in fn.arg_names}
        constexprs = {**missing, **constexprs}
    return _compile(fn, tuple(signature.items()), tuple(constexprs.items()), num_warps, num_stages, arch, maxnreg)


@dataclass(frozen=True)
class Plan:
    """One launch before compilation: the wrapper kernel, its parameters (inputs..., i32 scalars..., outputs...,
    as (name, triton type)), the scalars' values and the grid (ints for int shapes, shape expressions for
    TensorRT shape expressions), and the compile-time constants."""

    fn: object
    params: tuple
    scalars: dict
    constexprs: dict
    grid: tuple
    num_warps: int
    num_stages: int

    def launch(self, arch: int = 90) -> Launch:
        """The compiled contract (PTX for sm_`arch`; compiles without a GPU, cached per signature)."""
        return compile_launch(self.fn, self.params, self.scalars, self.constexprs, self.grid, self.num_warps,
                              self.num_stages, arch)


def compile_launch(fn, params, scalars: dict, constexprs: dict, grid, num_warps: int, num_stages: int,
                   arch: int = 90) -> Launch:
    """The `Launch` of kernel `fn` whose non-constexpr parameters are `params` ((name, triton type), in the
    kernel's order) with `constexprs` compiled in; grid and scalars are kept as given (ints, or TensorRT shape
    expressions in a plugin's aot_impl)."""
    types = dict(params)
    defaults = {p.name for p in fn.params if p.is_constexpr and p.has_default}     # compile at their defaults
    sig = {n: "constexpr" if n in constexprs else types[n] for n in fn.arg_names if n in constexprs or n in types
           or n not in defaults}
    kernel = compile_ptx(fn, sig, constexprs, num_warps, num_stages, arch)
    return Launch(kernel, tuple(grid), tuple(params), dict(scalars))


def trt_kernel_result(trtp, launch: Launch, grid, scalars) -> tuple:
    """What a `tensorrt.plugin` aot_impl returns for `launch`: (entry name, PTX, KernelLaunchParams with `grid`,
    block and dynamic shared memory, SymIntExprs of the integer `scalars` in parameter order). `trtp` is the
    `tensorrt.plugin` module (passed in: this module never imports TensorRT)."""
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = grid
    params.block_x = launch.block[0]
    params.shared_mem = launch.kernel.shared_mem
    scalars = list(scalars)
    extra = trtp.SymIntExprs(len(scalars))
    for i, value in enumerate(scalars):
        extra[i] = trtp.SymInt32(value)
    return launch.kernel.name, launch.kernel.ptx, params, extra


def trt_desc(trtp, like, shape, dtype):
    """A `tensorrt.plugin` output descriptor: `like`'s, with shape expression `shape` and `dtype`."""
    out = like.like()
    out.shape_expr = trtp.ShapeExprs.from_tuple(shape)
    out.dtype = dtype
    return out


@functools.lru_cache(maxsize=64)
def _compile(fn, sig_items, constexpr_items, num_warps, num_stages, arch, maxnreg) -> CompiledKernel:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs = dict(sig_items), dict(constexpr_items)
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    src = ASTSource(fn, signature, constexprs, attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    md = compiled.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise ValueError(f"{md.name} needs Triton scratch memory; an AOT plugin has no workspace")
    ptx = compiled.asm["ptx"]
    n_params = len(_entry_params(ptx, md.name))
    n_sig = sum(1 for t in signature.values() if t != "constexpr")
    return CompiledKernel(md.name, ptx, md.shared, num_warps, n_params - n_sig)


def _entry_params(ptx: str, name: str) -> list[str]:
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        raise ValueError(f"entry {name} not found in the PTX")
    return re.findall(r"\.param\s+\S+(?:\s+\S+)*?\s+(\w+_param_\d+)", m.group(1))


def launch_cupy(launch: Launch, tensors: dict[str, torch.Tensor]) -> None:
    """Run `launch` through the CUDA driver with cupy, binding pointer params to `tensors` by name and scalar
    params to `launch.scalars`. Synchronises torch before and after (cupy launches on its own null stream)."""
    import cupy
    import numpy as np

    fn = _cupy_function(launch.kernel.ptx, launch.kernel.name)
    smem = launch.kernel.shared_mem
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    scalar_np = {"i32": np.int32, "i64": np.int64, "fp32": np.float32, "u32": np.uint32}
    args = []
    for name, ty in launch.params:
        if ty.startswith("*"):
            t = tensors[name]
            if pointer_type(t.dtype) != ty:
                raise TypeError(f"{launch.kernel.name}: param {name} is {ty}, got a {t.dtype} tensor")
            args.append(np.uint64(t.data_ptr()))
        else:
            args.append(scalar_np[ty](launch.scalars[name]))
    args += [np.uint64(0)] * launch.kernel.hidden_params
    torch.cuda.synchronize()
    fn(launch.grid, launch.block, tuple(args), shared_mem=smem)
    cupy.cuda.runtime.deviceSynchronize()


@functools.lru_cache(maxsize=64)
def _cupy_function(ptx: str, name: str):
    import cupy

    path = os.path.join(tempfile.mkdtemp(prefix="k3aot-"), name + ".ptx")
    with open(path, "w") as fh:
        fh.write(ptx)
    return cupy.RawModule(path=path).get_function(name)
