"""Run the exported programs alone (no eager model): load a graph directory, check it, feed it a K3State.

`ExportedK3` has the eager model's serving surface (`config`, `device`, `new_state`, `prefill`, `decode`), so
`k3export.generate.generate(ExportedK3(dir), prompts, n)` drives prefill -> decode -> decode from the graphs.
Every call is checked against the manifest first: a dim beyond the exported maxima, a wrong dtype or rank, or
inconsistent lengths raise `GraphInputError` naming the input and the limit, before the graph runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from k3export.config import K3Config
from k3export.export import OUTPUTS
from k3export.manifest import ManifestError, check_graph_files, check_manifest, dtype_name, load_manifest
from k3export.model.k3 import _lengths
from k3export.model.state import K3State


class GraphInputError(ValueError):
    """An input does not fit the exported graph; the message names the input, the dim and the limit."""


def check_inputs(manifest: dict, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
    """Validate `inputs` against the manifest's signature of `graph`; returns the dynamic dim sizes."""
    specs = manifest["graphs"][graph]["inputs"]
    dims = manifest["dims"]
    names = [s["name"] for s in specs]
    if sorted(inputs) != sorted(names):
        raise GraphInputError(f"{graph} takes inputs {names}, got {sorted(inputs)}")
    sizes: dict[str, int] = {}
    for s in specs:
        t, name = inputs[s["name"]], s["name"]
        if dtype_name(t.dtype) != s["dtype"]:
            raise GraphInputError(f"{graph} input {name}: dtype {t.dtype}, the graph was exported for {s['dtype']}")
        if t.dim() != len(s["shape"]):
            raise GraphInputError(f"{graph} input {name}: shape {list(t.shape)}, expected {s['shape']}")
        for i, (have, want) in enumerate(zip(t.shape, s["shape"])):
            if isinstance(want, int):
                if have != want:
                    raise GraphInputError(f"{graph} input {name} dim {i}: {have}, the graph has {want}")
                continue
            lo, hi = dims[want]["min"], dims[want]["max"]
            if not lo <= have <= hi:
                raise GraphInputError(f"{graph} input {name} dim {i} ({want}) = {have} is outside the exported "
                                      f"range [{lo}, {hi}]; re-export with a larger --max-{_flag(want)}")
            if sizes.setdefault(want, have) != have:
                raise GraphInputError(f"{graph} input {name} dim {i} ({want}) = {have} but another input has "
                                      f"{want} = {sizes[want]}")
    for name, bound in (("lengths", "tokens"), ("cache_len", "past" if graph == "prefill" else "cache")):
        if name in inputs and inputs[name].numel():
            lo, hi = int(inputs[name].min()), int(inputs[name].max())
            if lo < 0 or hi > sizes[bound]:
                raise GraphInputError(f"{graph} input {name} must lie in [0, {bound}={sizes[bound]}], "
                                      f"got [{lo}, {hi}]")
    return sizes


def _flag(dim: str) -> str:
    return {"past": "cache"}.get(dim, dim)


class ExportedK3:
    """The two exported programs of a graph directory, re-loaded from disk.

    config_hash / weights: when given, refuse a directory exported from another config or checkpoint.
    versions: library versions to compare (default: the running ones; `{}` skips the check).
    check_files: refuse a graph file whose sha256 differs from the manifest (each file is hashed once, here);
    `verify` turns it off to report the difference in its table instead. A missing file is always refused."""

    def __init__(self, graph_dir: str | Path, config_hash: str | None = None, weights: str | None = None,
                 versions: dict[str, str] | None = None, check_files: bool = True):
        self.dir = Path(graph_dir)
        self.manifest = load_manifest(self.dir)
        check_manifest(self.manifest, config_hash=config_hash, weights=weights, versions=versions)
        check_graph_files(self.dir, self.manifest, sha256=check_files)
        if self.manifest["meta"]:
            raise ManifestError(f"{self.dir} was exported on the meta device: its graphs carry no weights and "
                                "cannot run (export from a checkpoint or a materialised preset)")
        self.config = K3Config.from_dict(self.manifest["config"])
        if self.device.type == "cuda":      # the graphs call the k3 ops: give them their Triton kernels
            from k3export.runtime import load_kernels
            self.kernels = load_kernels("cuda")
        self.dtype = getattr(torch, self.manifest["dtype"])
        if self.manifest.get("quant"):      # FP8 graphs call k3::fp8_linear / k3::moe_routed_fp8: register them
            import k3export.fp8_moe  # noqa: F401
        self.programs = {g: torch.export.load(self.dir / self.manifest["graphs"][g]["file"])
                         for g in ("prefill", "decode")}
        self._modules = {g: ep.module() for g, ep in self.programs.items()}

    @property
    def device(self) -> torch.device:
        """Where the graphs' weights live (the export's device; graphs exported before it was recorded: cpu)."""
        return torch.device(self.manifest.get("device", "cpu"))

    def new_state(self, batch: int, max_len: int) -> K3State:
        return K3State.empty(self.config, batch, max_len, dtype=self.dtype, device=self.device)

    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Call one graph with named inputs (checked); returns the named outputs."""
        check_inputs(self.manifest, graph, inputs)
        names = [s["name"] for s in self.manifest["graphs"][graph]["inputs"]]
        with torch.no_grad():
            out = self._modules[graph](*(inputs[n] for n in names))
        return dict(zip(OUTPUTS, out))

    def prefill(self, input_ids, state: K3State, lengths=None):
        """As `K3Model.prefill`: input_ids `[B, T]`, continuing `state` in place. Returns logits `[B, T, V]`."""
        B, T = input_ids.shape
        lengths = _lengths(lengths, B, T, input_ids.device)
        used = int(state.lengths.max()) if state.batch else 0
        out = self.run("prefill", {"input_ids": input_ids, "lengths": lengths, "kda_conv": state.kda_conv,
                                   "kda_state": state.kda_state, "mla_cache": state.mla_cache[:, :, :used],
                                   "cache_len": state.lengths})
        state.commit(out["kda_conv_out"], out["kda_state_out"], out["mla_rows"], lengths)
        return out["logits"]

    def decode(self, input_ids, state: K3State):
        """As `K3Model.decode`: one token per sequence `[B]`. Returns logits `[B, V]`."""
        used = int(state.lengths.max())
        if used >= state.max_len:
            raise ValueError(f"the state is full (max_len={state.max_len}); allocate a larger K3State")
        out = self.run("decode", {"input_ids": input_ids, "kda_conv": state.kda_conv, "kda_state": state.kda_state,
                                  "mla_cache": state.mla_cache[:, :, :max(used, 1)], "cache_len": state.lengths})
        state.commit(out["kda_conv_out"], out["kda_state_out"], out["mla_rows"], 1)
        return out["logits"]
