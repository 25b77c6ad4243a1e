"""What packing the projections that share an input would save in a k3-small decode step (B = 1, bf16, GPU).

For each group of one decode layer (KDA's six input projections, MLA's three, the MoE's routed down projection
with the shared expert's gate and up, the MoE's two output projections as one K-concatenated GEMV), times the
separate `F.linear` calls against one call on the packed weight. Each variant is captured as a CUDA graph of
`REPS` layers with their own weights (more bytes than L2 holds), replayed after warm-up, timed with CUDA events;
reported per layer, with the bytes read per layer against the copy bandwidth measured in the same run.

    python3 scripts/gemv_pack_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

REPS = 16
# name -> (list of (N, K) weights sharing the input x [1, K]); k3-small: d 2048, H*K 2048, q_lora 768, latent 576
GROUPS = {
    "kda_in (q,k,v,g,f_a,b)": [(2048, 2048)] * 4 + [(128, 2048), (16, 2048)],
    "mla_in (q_a,kv_a,g)": [(768, 2048), (576, 2048), (2048, 2048)],
    "moe_in (down,shared gate,up)": [(1024, 2048), (768, 2048), (768, 2048)],
    "moe_out (up | shared down, K concat)": [(2048, 1024), (2048, 768)],
}


def replay_ms(replay, iters=50) -> list[float]:
    """ms of each of `iters` calls of replay() (a CUDA-graph replay), CUDA events, after 5 warm-up calls."""
    for _ in range(5):
        replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return times


def timed(fn, iters=50):
    """Median ms of a CUDA-graph replay of fn (captured by the benches' `_graphed`), CUDA events, after warm-up."""
    from k3export.bench.layer import _graphed
    times = sorted(replay_ms(_graphed(fn), iters))
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """GB/s of a 128 MiB device-to-device copy, timed as the GEMVs are."""
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    return 2 * (1 << 27) / timed(lambda: big[: 1 << 27].copy_(big[1 << 27:])) / 1e6


def probe_start() -> tuple[str | None, float]:
    """A probe's command line (`--out PATH` for its JSON) and the measured copy bandwidth (GB/s)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    return ap.parse_args().out, copy_bandwidth()


def write_json(out: str | None, result: dict) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    out, copy_gbs = probe_start()
    dev, dt = "cuda", torch.bfloat16
    print(f"copy {copy_gbs:.0f} GB/s")
    rows = {}
    for name, shapes in GROUPS.items():
        kcat = "K concat" in name
        nbytes = sum(n * k for n, k in shapes) * 2
        ws = [[torch.randn(n, k, device=dev, dtype=dt) for n, k in shapes] for _ in range(REPS)]
        xs = [torch.randn(1, k, device=dev, dtype=dt) for _, k in shapes]
        if kcat:
            packed = [torch.cat(w, dim=1) for w in ws]
            xcat = torch.cat(xs, dim=1)
            sep = lambda: [sum(F.linear(x, w) for x, w in zip(xs, wl)) for wl in ws]
            one = lambda: [F.linear(xcat, p) for p in packed]
        else:
            packed = [torch.cat(w, dim=0) for w in ws]
            sep = lambda: [[F.linear(xs[0], w) for w in wl] for wl in ws]
            one = lambda: [F.linear(xs[0], p).split([n for n, _ in shapes], dim=-1) for p in packed]
        t_sep, t_one = timed(sep) / REPS, timed(one) / REPS
        # the packed result equals the separate one up to summation order
        ref = torch.cat([F.linear(xs[0], w) for w in ws[0]], -1) if not kcat else sum(
            F.linear(x, w) for x, w in zip(xs, ws[0]))
        got = F.linear(xcat if kcat else xs[0], packed[0])
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        rows[name] = dict(launches=len(shapes), mb=nbytes / 1e6, sep_us=1e3 * t_sep, packed_us=1e3 * t_one,
                          sep_gbs=nbytes / t_sep / 1e6, packed_gbs=nbytes / t_one / 1e6, rel_err=err)
        print(f"{name:40s} {nbytes / 1e6:6.1f} MB  separate x{len(shapes)} {1e3 * t_sep:6.1f} us "
              f"({nbytes / t_sep / 1e6:5.0f} GB/s)  packed {1e3 * t_one:6.1f} us ({nbytes / t_one / 1e6:5.0f} GB/s)"
              f"  rel err {err:.1e}")
    write_json(out, dict(copy_gbs=copy_gbs, groups=rows))


if __name__ == "__main__":
    main()
