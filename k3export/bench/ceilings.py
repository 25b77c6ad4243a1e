"""The measured ceilings that benchmarks report against: device copy bandwidth and the bf16 matmul rate.

Measured in the same run as the kernel they judge (never copied from a table), with `triton.testing.do_bench`
medians; do_bench flushes L2 between repetitions, so memory-bound kernels are timed from HBM.
"""

from __future__ import annotations

import functools

import torch


def bench_ms(fn, rep: int = 100) -> float:
    """Median milliseconds of fn() (L2 flushed between calls)."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def graph_replay(fn, warmup: int = 1):
    """fn() captured once in a CUDA graph, after `warmup` calls on a side stream; returns the graph's replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def graph_ms(fn) -> float:
    """Median ms of fn replayed as a CUDA graph (captured after a warm-up on a side stream; L2 flushed): the device
    time without the host's launch overhead, which `bench_ms` of a small call mostly measures. How the runtime's
    decode runs."""
    return bench_ms(graph_replay(fn))


def kernel_times(call, reps: int = 5, warmup: int = 0) -> list[dict]:
    """Device time per CUDA kernel name for one `call` (torch profiler over `reps` calls after `warmup`, L2 not
    flushed), largest first: [{"kernel", "us", "count"}], us and count per call."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us:
            rows.append({"kernel": ev.key, "us": us / reps, "count": ev.count / reps})
    return sorted(rows, key=lambda r: -r["us"])


def critical_path(kernels: list[tuple[str, float, float]]) -> dict:
    """Where the span of a stream of kernels goes when they may overlap (PDL lets a kernel start before its
    predecessor ends): kernels (name, start, end), any time unit. Walking them by start, each kernel is charged
    the part of it that ends past every kernel before it (its exposed time); the time when nothing ran is idle.
    exposed + idle = span. Returns {"span", "idle", "busy" (sum of durations), "by_name": {name: [count,
    exposed]}}, by_name largest exposed first."""
    span = idle = busy = 0.0
    by: dict[str, list] = {}
    frontier = None
    for name, start, end in sorted(kernels, key=lambda k: (k[1], k[2])):
        busy += end - start
        if frontier is None:
            frontier, first = start, start
        idle += max(0.0, start - frontier)
        exposed = max(0.0, end - max(start, frontier))
        frontier = max(frontier, end)
        c = by.setdefault(name, [0, 0.0])
        c[0] += 1
        c[1] += exposed
    if frontier is not None:
        span = frontier - first
    return {"span": span, "idle": idle, "busy": busy,
            "by_name": dict(sorted(by.items(), key=lambda kv: -kv[1][1]))}


@functools.lru_cache(maxsize=None)
def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted) of nbytes."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    del a, b
    return 2 * nbytes / (ms * 1e-3)


@functools.lru_cache(maxsize=None)
def matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an n^3 bf16 matmul on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = bench_ms(lambda: a @ b)
    return 2 * n ** 3 / (ms * 1e-3)


def fp8_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an n^3 E4M3 x E4M3 -> bf16 `torch._scaled_mm` (per-tensor scales) on random data."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()          # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    ms = bench_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return 2 * n ** 3 / (ms * 1e-3)


def machine() -> str:
    p = torch.cuda.get_device_properties(0)
    import triton
    return f"{p.name} ({p.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}"
