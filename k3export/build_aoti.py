"""The `aoti` backend: AOTInductor packages of the exported prefill and decode graphs.

Build: each graph of an export directory (`k3export export`) is compiled by `aoti_compile_and_package` with the
weights kept *outside* the package (`package_constants_in_so=False`), so the two packages share the engine's one
`weights.safetensors` and a package is a few MiB whatever the model size. The two graphs compile in parallel
processes, and each package is cached under `$K3EXPORT_CACHE` (default `~/.cache/k3export/aoti`) keyed by the
graph file's sha256, the library versions, the device and the Inductor options: an unchanged input is reused
without compiling.

Kernels: with `K3EXPORT_AOTI_KERNELS=1`, a CUDA engine's k3 ops are first lowered into their Triton launches
(`k3export.aoti_lower`), so Inductor compiles the k3 Triton kernels into the package. This is opt-in: on the H200
(2026-11-30, torch 2.11, Triton 3.6) Inductor's compile of the lowered MLA kernels failed (a `tl.dot` accumulator
assertion in its autotuning subprocess) and the build fell back to extern calls after ~110 s of trying. Cause,
found afterwards on CPU: Inductor types Python float kernel arguments as fp64, which turned the MLA softmax and
accumulator fp64; the kernels now cast their float arguments to fp32 (tests/test_aoti_lower.py compiles each with
fp64 arguments), but the compile-in path has not run on a GPU since, so it stays opt-in. By default every k3 op stays an extern call through the op dispatcher (their registered
Triton kernels on CUDA). With the switch on, an op that cannot be lowered (its kernel does not serve the graph's
dtype/dims, or its kernel is switched off) stays extern, and a failed compile falls back to extern calls.
The manifest's `aoti.kernels` says per graph which ops were compiled in and why the others were not, and
`aoti.extern_ops` lists the ops a package still calls. A CPU engine keeps every k3 op as an extern call (their
torch references).

Load: `aoti_load_package` + `load_constants` (user managed: both programs point at the same weight tensors).
Nothing of the model's Python code is imported when `extern_ops` is empty; otherwise the op library
(`k3export.plugins`) is imported first, and a missing op is refused with its name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch

from k3export.build import PRECISIONS, WEIGHTS, EngineError, _versions, device_slug
from k3export.config import K3Config

GRAPHS = ("prefill", "decode")
CONSTANT_PREFIX = "model."                  # export wraps the model as `PrefillGraph.model` / `DecodeGraph.model`
INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False}
KERNELS_SWITCH = "K3EXPORT_AOTI_KERNELS"    # =1: compile the k3 Triton kernels into CUDA packages (see above)


def package_name(graph: str) -> str:
    return f"{graph}.aoti.pt2"


def cache_root() -> Path:
    return Path(os.environ.get("K3EXPORT_CACHE", Path.home() / ".cache" / "k3export")) / "aoti"


def report_name(graph: str) -> str:
    return f"{graph}.aoti.json"


def cache_key(graph_sha: str, device) -> str:
    blob = json.dumps([graph_sha, _versions(), device_slug(device), INDUCTOR_CONFIGS, kernels_fingerprint(device)],
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def kernels_fingerprint(device) -> str | None:
    """For a CUDA engine the package holds the k3 kernels: a change to their source (plugins/**.py, the lowering
    pass) or to the K3_* environment switches that pick kernels and tiles makes a new cache key. None on CPU."""
    if torch.device(device).type != "cuda":
        return None
    import k3export.plugins
    h = hashlib.sha256()
    roots = [Path(k3export.plugins.__file__).parent, Path(__file__).with_name("aoti_lower.py")]
    for f in sorted(p for r in roots for p in ([r] if r.is_file() else r.rglob("*.py"))):
        h.update(f.name.encode() + f.read_bytes())
    h.update(json.dumps(sorted((k, v) for k, v in os.environ.items()
                               if k.startswith("K3_") or k in ("K3EXPORT_AOTI_EXTERN", KERNELS_SWITCH))).encode())
    return h.hexdigest()[:16]


def build_aoti(model, out: Path, graphs, manifest: dict, log, echo) -> dict[str, str]:
    """Compile (or reuse) both packages into `out`; returns {file name: path relative to out}."""
    from k3export.manifest import check_graph_files, check_manifest, dtype_name, load_manifest
    if graphs is None:
        from k3export.export import ExportLimits, export_graphs
        graphs = out / "graphs"
        lim = manifest["profiles"]
        limits = ExportLimits(max_batch=max(lim["prefill"]["batch"][2], lim["decode"]["batch"][2]),
                              max_tokens=lim["prefill"]["tokens"][2], max_cache=lim["decode"]["cache"][2])
        log.step("export (prefill + decode graphs)", export_graphs, model, graphs, limits,
                 {"weights": manifest["weights"]}, log=log.note)
    graphs = Path(graphs)
    try:
        gm = load_manifest(graphs)
        check_manifest(gm, config_hash=manifest["config_hash"])
        check_graph_files(graphs, gm)          # the cache key below is the manifest's sha: it must be the file's
    except ValueError as e:
        raise EngineError(str(e)) from None
    if gm["dtype"] != dtype_name(model.dtype):
        raise EngineError(f"graphs in {graphs} are {gm['dtype']}, the engine is {manifest['precision']}; "
                          "re-export at the engine's precision")
    manifest["graphs"] = {"dir": str(graphs), "config_hash": gm["config_hash"],
                          "sha256": {g: gm["graphs"][g]["sha256"] for g in GRAPHS}}
    manifest["profiles"] = profiles_from_dims(gm)
    device = model.device
    todo, files = {}, {}
    for g in GRAPHS:
        key = cache_key(gm["graphs"][g]["sha256"], device)
        cached = cache_root() / key / package_name(g)
        if not (cached.exists() and cached.with_name(report_name(g)).exists()):
            todo[g] = (str(graphs / gm["graphs"][g]["file"]), str(cached), device.type)
        else:
            log.note(f"{g}: reused cached package {cached} (key {key})")
            echo(f"{g}: unchanged graph, reused the cached AOTI package {cached}")
        files[g] = cached
    if todo:
        echo(f"AOTInductor: compiling {', '.join(todo)} ({'in parallel' if len(todo) > 1 else 'one graph'}; "
             "cached for the next build)")
        log.step(f"aoti compile ({' + '.join(todo)}, parallel)", _compile_parallel, todo)
    kernels = {g: json.loads((files[g].parent / report_name(g)).read_text()) for g in GRAPHS}
    extern = sorted({op for r in kernels.values() for op in r["extern"]})
    for g, r in kernels.items():
        log.note(f"{g}: k3 ops compiled in: {r['compiled_in'] or 'none'}; extern calls: {r['extern'] or 'none'}")
        if "compile_error" in r:
            log.note(f"{g}: compiling the kernels in failed, the package calls the ops instead: {r['compile_error']}")
            echo(f"WARNING: {g}: compiling the k3 kernels into the package failed ({r['compile_error'][:200]}); "
                 "built with extern calls instead (see build.log)")
    if extern:
        echo(f"AOTI packages call {', '.join(extern)} through the op dispatcher: loading them imports "
             "k3export.plugins (see the manifest's aoti.kernels for why)")
    manifest["aoti"] = {"constant_prefix": CONSTANT_PREFIX, "inductor_configs": INDUCTOR_CONFIGS,
                        "cache_keys": {g: files[g].parent.name for g in GRAPHS}, "kernels": kernels,
                        "extern_ops": extern}
    names = {}
    for g in GRAPHS:
        dst = out / package_name(g)
        dst.unlink(missing_ok=True)
        try:
            os.link(files[g], dst)
        except OSError:
            shutil.copyfile(files[g], dst)
        names[dst.name] = dst.name
    return names


def profiles_from_dims(gm: dict) -> dict:
    """Engine profiles (min/opt/max per named dim) from the export's dynamic dims."""
    d = gm["dims"]

    def mmo(name, opt):
        lo, hi = d[name]["min"], d[name]["max"]
        return [lo, min(max(opt, lo), hi), hi]

    return {"prefill": {"batch": mmo("batch", 1), "tokens": mmo("tokens", 128), "past": mmo("past", 0)},
            "decode": {"batch": mmo("batch", 8), "cache": mmo("cache", 1024)}}


def _compile_parallel(todo: dict) -> None:
    if len(todo) == 1:
        (args,) = todo.values()
        _compile_one(*args)
        return
    with ProcessPoolExecutor(max_workers=len(todo), mp_context=get_context("spawn")) as pool:
        for f in [pool.submit(_compile_one, *args) for args in todo.values()]:
            f.result()


def _compile_one(pt2: str, package: str, device_type: str) -> None:
    """Worker: load one exported graph, lower its k3 ops into Triton launches (CUDA), compile it into `package`
    (written atomically) and write the lowering report beside it (`report_name`)."""
    import time
    import warnings
    # torch's own unpickling of the graph's tree specs (torch 2.13) warns that LeafSpec is deprecated: nothing a
    # user of the build can act on, printed once per worker
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    import k3export.plugins  # noqa: F401  (registers the k3 ops the graph calls)
    from k3export.aoti_lower import k3_nodes, lower_k3_ops, op_name
    from k3export.manifest import atomic_write, replacing
    from k3export.runtime import load_kernels
    load_kernels(device_type)
    exported = torch.export.load(pt2)
    t0 = time.perf_counter()
    if device_type == "cuda" and os.environ.get(KERNELS_SWITCH) == "1":
        ep, report = lower_k3_ops(exported)
    else:
        why = ("cpu engine: the op's torch reference runs as an extern call" if device_type != "cuda" else
               f"extern call to the op's registered Triton kernel (compiling the kernels in is opt-in: {KERNELS_SWITCH}=1)")
        ep, report = exported, {"compiled_in": {}, "launches": {},
                                "extern": {op_name(op): why for op in k3_nodes(exported.graph_module)}}
    report["lower_s"] = round(time.perf_counter() - t0, 2)
    Path(package).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        with replacing(package) as tmp:
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs=INDUCTOR_CONFIGS)
    except Exception as e:                              # noqa: BLE001 (the build still yields a working package)
        if ep is exported:
            raise
        report["compile_error"] = f"{type(e).__name__}: {str(e).strip()[:1000]}"
        report["extern"].update({op: "the package with the kernels compiled in failed to build (compile_error)"
                                 for op in report["compiled_in"]})
        report["compiled_in"], report["launches"] = {}, {}
        with replacing(package) as tmp:
            torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp),
                                                     inductor_configs=INDUCTOR_CONFIGS)
    report["compile_s"] = round(time.perf_counter() - t0, 2)
    graph = Path(package).name.split(".")[0]
    atomic_write(Path(package).with_name(report_name(graph)), json.dumps(report, indent=2) + "\n")


def load_extern_ops(aoti: dict, path: Path, device: torch.device) -> list[str]:
    """Register the k3 ops the packages still call (none when every op was compiled in); returns their names.
    Manifests from before the lowering pass have no `extern_ops`: every k3 op is then an extern call."""
    extern = aoti.get("extern_ops", ["attn_res", "kda_decode", "kda_prefill", "mla_decode", "mla_prefill",
                                     "moe_routed"])
    if not extern:
        return extern
    try:
        import k3export.plugins  # noqa: F401
        from k3export.runtime import load_kernels
    except ImportError as e:
        raise EngineError(f"the AOTI packages in {path} call the k3 ops {extern} through the op dispatcher and "
                          f"k3export.plugins cannot be imported ({e}); install k3export or rebuild on a GPU "
                          "where the ops compile in") from None
    load_kernels(device.type)
    missing = [op for op in extern if not hasattr(torch.ops.k3, op)]
    if missing:
        raise EngineError(f"the AOTI packages in {path} call k3 ops that are not registered: {missing}")
    return extern


class AOTIBackend:
    """Runs the two packages; the `runtime.Backend` interface."""

    name = "aoti"

    def __init__(self, path: Path, manifest: dict, device: torch.device):
        from safetensors.torch import load_file
        load_extern_ops(manifest["aoti"], path, device)
        self.config = K3Config.from_dict(manifest["config"])
        self.dtype, self.device = PRECISIONS[manifest["precision"]], device
        self.max_prefill_tokens = manifest["profiles"]["prefill"]["tokens"][2]
        weights = load_file(str(path / WEIGHTS), device=str(device))
        prefix = manifest["aoti"]["constant_prefix"]
        if device.type == "cuda" and device.index is not None:    # a bare "cuda" means the current device
            torch.cuda.set_device(device)
        self._run = {}
        for g in GRAPHS:
            pkg = torch._inductor.aoti_load_package(str(path / package_name(g)), run_single_threaded=True)
            fqns = pkg.get_constant_fqns()
            missing = [f for f in fqns if f.removeprefix(prefix) not in weights]
            if missing:
                raise EngineError(f"{path / package_name(g)} needs constants missing from {WEIGHTS}: {missing[:4]}"
                                  " (the package and the weights come from different builds; rebuild)")
            pkg.load_constants({f: weights[f.removeprefix(prefix)] for f in fqns}, check_full_update=True,
                               user_managed=True)
            self._run[g] = pkg
        self._weights = weights                     # user-managed constants: keep them alive

    def prefill(self, input_ids, lengths, kda_conv, kda_state, mla_cache, cache_len):
        return tuple(self._run["prefill"](input_ids, lengths, kda_conv.contiguous(), kda_state.contiguous(),
                                          mla_cache.contiguous(), cache_len))

    def decode(self, input_ids, kda_conv, kda_state, mla_cache, cache_len):
        return tuple(self._run["decode"](input_ids, kda_conv, kda_state, mla_cache, cache_len))
