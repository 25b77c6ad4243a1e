"""Draw `k3export bench moe`'s plot from one or more of its JSON files (e.g. a bf16 run and an `--precision fp8`
run kept in docs/results), their rows merged per section; --tiles keeps only the named tilings.

    python3 scripts/plot_moe.py docs/results/2026-11-30/moe-paired-0946.json \\
        docs/results/2026-11-30/moe-fp8-2351.json --out docs/moe-h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from k3export.bench.moe import plot


def merged(paths: list[Path], tiles: set[str] | None) -> tuple[dict, str]:
    res, runs = {}, []
    for p in paths:
        d = json.loads(p.read_text())
        runs.append(f"{d['date'][:16]} ({d['matmul_TFLOPs']:.0f} TFLOP/s)")
        for sec in ("prefill", "prefill_fp8", "decode"):
            res.setdefault(sec, []).extend(r for r in d.get(sec, []) if tiles is None or r.get("tiles") in tiles)
    machine = json.loads(paths[0].read_text())["machine"]
    return res, f"{machine}; runs {', '.join(runs)}: % of each run's own bf16 matmul rate"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiles", default="", help="comma-separated tiling names to keep (default: all)")
    a = ap.parse_args()
    res, title = merged(a.json, {t for t in a.tiles.split(",") if t} or None)
    print(plot(res, a.out, title) or "matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
