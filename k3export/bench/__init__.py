"""`k3export bench ...`: benchmarks. Each module here adds one subcommand to the `bench` group; results carry
date, machine and command, and are never asserted on (see docs/perf.md)."""

from __future__ import annotations

import importlib
import importlib.util
import shlex

import click


@click.group("bench")
def bench() -> None:
    """Benchmarks: kernels against their baselines, and end-to-end latency against eager PyTorch."""


def require_cuda(name: str) -> None:
    """Stop a GPU-only benchmark on a machine without CUDA with a message instead of torch's traceback."""
    import torch
    if not torch.cuda.is_available():
        raise click.ClickException(f"bench {name} needs a CUDA GPU (run it on the GPU machine; `k3export bench model "
                                   "--device cpu` times the CPU backends)")


def command_line(ctx: click.Context, prefix: str, skip: tuple[str, ...] = ()) -> str:
    """The command that reruns this one, as every bench records it with its results (not `sys.argv`, which under
    a test runner is the runner's): `prefix`, then every option set (given or by default) as its user types it, a
    flag pair by the name of its value (`--no-new-lengths`, not `--new-lengths False`)."""
    parts = [prefix]
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if p.name in skip or v is None or not isinstance(p, click.Option):
            continue
        if p.is_flag:
            name = p.opts[0] if v else (p.secondary_opts or [None])[0]
            if name:
                parts.append(name)
        else:
            parts.append(f"{p.opts[0]} {shlex.quote(str(v))}")
    return " ".join(parts)


# One entry per benchmark module (k3export/bench/<name>.py defines `@bench.command(...)`).
BENCH_MODULES = ("kda", "mla", "moe", "layer", "model", "fp8")

for _name in BENCH_MODULES:
    if importlib.util.find_spec(f"{__name__}.{_name}") is not None:
        importlib.import_module(f"{__name__}.{_name}")
