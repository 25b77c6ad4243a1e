"""How long a small load, and a store seen by another SM's poll, take while the weight stream runs (GPU only).

chain.cu's phase boundaries are a store by the last block of a phase and polls by the next phase's blocks, under the
producers' bulk copies. This measures both round trips (scripts/l2_queue_probe.cu) with no stream and with the
stream holding 1..K copies of S bytes in flight per SM, and the stream's bandwidth, to see how much of a boundary is
the memory system's queueing and whether fewer bytes in flight keep the bandwidth while queueing less. One hop
(store to poll, timed on %globaltimer) is also timed with only the writers' or only the readers' SMs streaming.

    python scripts/l2_queue_probe.py [--configs 65536x0,65536x1,...] [--samples 400] [--out probe.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

CU = Path(__file__).with_suffix(".cu")
DEFAULT = ("65536x0,65536x1,65536x2,65536x3,32768x1,32768x2,32768x3,32768x4,32768x6,"
           "16384x2,16384x4,16384x6,16384x8,16384x12")


def build(out_dir: str):
    import cupy
    path = str(Path(out_dir) / "l2_queue_probe.cubin")
    subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-cubin", "-o", path, str(CU)],
                   check=True)
    return cupy.RawModule(path=path).get_function("probe")


def cell(r: dict) -> str:
    return f"{r['median_us']:5.2f} ({r['p10_us']:.2f}-{r['p90_us']:.2f})"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


MODES = ("load", "pingpong", "hop")
WHO = ("all", "writers", "readers")


def run(fn, slot: int, inflight: int, mode: int, samples: int, buf: torch.Tensor, blocks: int, who: int = 0) -> dict:
    import cupy
    words = torch.zeros(blocks * 32, dtype=torch.int64, device="cuda")
    lat = torch.zeros(blocks * samples, dtype=torch.int64, device="cuda")
    streamed = torch.zeros(blocks, dtype=torch.int64, device="cuda")
    span = torch.zeros(2 * blocks, dtype=torch.int64, device="cuda")
    smem = max(inflight, 1) * slot
    fn.max_dynamic_shared_size_bytes = smem
    with warnings.catch_warnings():                              # (cupy 14 prefers Stream.from_external)
        warnings.simplefilter("ignore", DeprecationWarning)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    args = (buf.data_ptr(), cupy.uint64(buf.numel()), cupy.int32(slot), cupy.int32(inflight), words.data_ptr(),
            lat.data_ptr(), cupy.int32(samples), cupy.int32(mode), cupy.uint64(20_000), streamed.data_ptr(),
            span.data_ptr(), cupy.int32(who))
    fn((blocks,), (64,), args, shared_mem=smem, stream=stream)
    torch.cuda.synchronize()
    lat = lat.view(blocks, samples).cpu()
    half = blocks // 2
    if mode == 2:                                               # the reader's time minus the writer's
        rows = lat[half:2 * half] - lat[:half]
    else:
        rows = lat[:half] if mode == 1 else lat                 # (ping-pong: the side that times round trips)
    xs = [v / 1000 for v in rows[:, 10:].flatten().tolist()]   # us, the first 10 samples a block dropped
    out = {"slot": slot, "inflight": inflight, "mode": MODES[mode], "who": WHO[who],
           "median_us": statistics.median(xs), "p10_us": pct(xs, 0.1), "p90_us": pct(xs, 0.9)}
    if inflight:
        sp = span.view(blocks, 2).cpu()
        secs = (sp[:, 1].max() - sp[:, 0].min()).item() / 1e9
        out["tb_s"] = streamed.sum().item() / secs / 1e12
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=DEFAULT, help="SLOTxINFLIGHT, comma-separated (inflight 0: no stream)")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--out")
    a = ap.parse_args()
    fn = build(tempfile.mkdtemp(prefix="l2probe-"))
    blocks = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    results = []
    print(f"{'slot':>6} {'inflight':>8} {'KB/SM':>6} {'TB/s':>6} | load us med (p10-p90) | ping-pong us med (p10-p90) "
          f"| one hop us med (p10-p90): all stream / writers' SMs / readers' SMs")
    for c in a.configs.split(","):
        slot, inflight = (int(v) for v in c.split("x"))
        r = [run(fn, slot, inflight, m, a.samples, buf, blocks) for m in (0, 1)]
        hops = [run(fn, slot, inflight, 2, a.samples, buf, blocks, w) for w in ((0, 1, 2) if inflight else (0,))]
        results += r + hops
        bw = f"{r[0]['tb_s']:6.2f}" if inflight else "     -"
        print(f"{slot:6d} {inflight:8d} {slot * inflight // 1024:6d} {bw} | {cell(r[0])} | {cell(r[1])} | "
              + " / ".join(cell(h) for h in hops), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
