"""The `tensorrt` backend: a thin layer over the TensorRT 11 Python API. NOT RUN: TensorRT cannot be installed on
the machines this project has (see docs/deployment-notes.md); everything here except the `trt.*` calls is plain
data computed and tested without it (`profile_shapes`).

The ONNX carries one node per k3 op while the plugins are one per kernel launch: `plugin_onnx` rewrites each graph
into plugin nodes (`k3export.trt_onnx`, every k3 op of both graphs), and `build_tensorrt` refuses a graph that still
has a node no registered AOT plugin takes, naming it (`plugin_gaps`).

Build, per graph: the ONNX from `k3export onnx` (k3 ops are bare plugin nodes, domain `k3`) -> a strongly typed
network (precision comes from the tensor dtypes) -> one optimisation profile whose min/opt/max come from the
graph manifest's named dims -> a serialized engine, with a shared timing cache kept in the engine directory so
a rebuild reuses the tactic timings. The k3 plugins are registered by importing each `plugins/<op>/trt.py`
(their `tensorrt.plugin` AOT definitions: Triton PTX + launch contracts).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from k3export.build import PRECISIONS, TENSORRT_INSTALL, EngineError, TensorRTMissing, check_fp8_backend
from k3export.config import K3Config
from k3export.trt_onnx import MOE_DECODE_MAX_PAIRS

GRAPHS = ("prefill", "decode")
TIMING_CACHE = "timing.cache"
PLUGIN_MODULES = ("kda.trt", "mla.trt", "moe.trt", "moe.trt_fp8")     # AttnRes: standard ONNX ops, no plugin


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise TensorRTMissing(TENSORRT_INSTALL) from None
    if int(trt.__version__.split(".")[0]) < 11:
        raise EngineError(f"TensorRT {trt.__version__} found; the k3 engines need TensorRT >= 11 (strongly typed "
                          "networks, AOT plugins). " + TENSORRT_INSTALL.split(": ", 1)[1])
    return trt


def profile_shapes(inputs: list[dict], profile: dict[str, list[int]], fixed: dict[str, int] | None = None
                   ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) shape per graph input, from its manifest shape (ints and dim names) and the profile's
    `[min, opt, max]` per dim name. A named dim missing from the profile must be in `fixed`."""
    fixed = fixed or {}
    out = {}
    for spec in inputs:
        rows = []
        for i in range(3):
            shape = []
            for d in spec["shape"]:
                if isinstance(d, int):
                    shape.append(d)
                elif d in profile:
                    shape.append(profile[d][i])
                elif d in fixed:
                    shape.append(fixed[d])
                else:
                    raise EngineError(f"input {spec['name']}: dim '{d}' has no profile entry")
            rows.append(tuple(shape))
        out[spec["name"]] = tuple(rows)
    return out


# What the registered AOT plugins (one per kernel launch, `plugins/<op>/trt.py`) give each k3 node of the ONNX from
# `k3export onnx` (one bare node per op). TensorRT's ONNX parser makes a node the plugin named by its op_type in
# its domain, and an AOT one only with the node attribute aot=1 (docs/deployment-notes.md). So a node parses only
# as one launch with aot=1: `plugin_onnx` (`k3export.trt_onnx`) rewrites each op node into its launch chain
# (intermediate tensors between the plugin nodes) and AttnRes into standard ops. The MoE has two chains: the decode
# one below up to MOE_DECODE_MAX_PAIRS (token, expert) pairs, the prefill one (`MOE_PREFILL_CHAIN`) beyond.
MOE_PREFILL_CHAIN = ("moe_router", "moe_topk", "moe_count", "moe_plan", "moe_scatter", "moe_gemm1", "moe_gemm2",
                     "moe_combine")
PLUGIN_CHAINS = {
    "kda_decode": ("kda_decode",),
    "mla_prefill": ("mla_prefill",),
    "kda_prefill": ("kda_prefill_intra", "kda_prefill_chunks"),
    "mla_decode": ("mla_decode_split", "mla_decode_combine"),
    "moe_routed": ("moe_router", "moe_topk", "moe_align", "moe_gemm1", "moe_gemm2", "moe_combine"),
    "moe_routed_fp8": ("moe_router", "moe_topk", "moe_align", "moe_fp8_wo_gemm1", "moe_fp8_wo_gemm2",
                       "moe_combine"),
}
# The FP8 experts' other regime (W8A8, past 4 pairs per expert at max_tokens: `plugins/moe/trt_fp8.py`).
MOE_FP8_W8A8 = ("moe_fp8_quant", "moe_fp8_gemm1", "moe_fp8_gemm2")
PLUGINS = {p for chain in (*PLUGIN_CHAINS.values(), MOE_PREFILL_CHAIN, MOE_FP8_W8A8) for p in chain}
NO_CHAIN = {"attn_res": "no AttnRes plugin (`k3export.trt_onnx` rewrites the mix into standard ONNX ops)"}


def plugin_gaps(onnx_path: Path) -> dict[str, str]:
    """op -> why TensorRT cannot take that op's nodes from this graph's ONNX as written (empty: every k3 node is
    one registered AOT plugin with aot=1). Reads the node list only (no weights)."""
    import onnx
    model = onnx.load(str(onnx_path), load_external_data=False)
    gaps = {}
    for node in model.graph.node:
        if node.domain != "k3" or node.op_type in gaps:
            continue
        op = node.op_type
        why = NO_CHAIN.get(op)
        chain = PLUGIN_CHAINS.get(op)
        if why is None and op in PLUGINS:
            if not any(a.name == "aot" and a.i == 1 for a in node.attribute):
                why = "no aot=1 attribute on the node"
        elif why is None and chain is None:
            why = "no plugin registered under this name"
        elif why is None:
            why = f"{len(chain)} plugins ({', '.join('k3::' + c for c in chain)}): the node must be rewritten into them"
            if op in ("moe_routed", "moe_routed_fp8"):
                why += (f" (beyond {MOE_DECODE_MAX_PAIRS} (token, expert) pairs the {len(MOE_PREFILL_CHAIN)} of the "
                        "prefill chain)")
        if why:
            gaps[op] = why
    return gaps


def plugin_onnx(onnx_path: Path, graph: str, manifest: dict, profiles: dict) -> Path:
    """`<graph>.trt.onnx` beside the ONNX (its weights stay in the same external-data file): the k3 op nodes
    rewritten into their AOT plugin nodes (`k3export.trt_onnx`), written atomically."""
    import onnx
    from k3export.aoti_lower import mla_decode_splits
    from k3export.manifest import atomic_write
    from k3export.trt_onnx import rewrite
    cfg = K3Config.from_dict(manifest["config"])
    elem = {"fp32": onnx.TensorProto.FLOAT, "bf16": onnx.TensorProto.BFLOAT16,
            "fp16": onnx.TensorProto.FLOAT16}[manifest["precision"]]
    splits = mla_decode_splits(cfg.num_attention_heads, profiles["decode"]["cache"][2], torch.device("cuda"))
    model = onnx.load(str(onnx_path), load_external_data=False)
    p = profiles[graph]
    max_tokens = p["batch"][2] * (p["tokens"][2] if graph == "prefill" else 1)       # the MoE's largest N
    try:
        out, _ = rewrite(model, graph, elem, max_tokens, splits)
    except ValueError as e:
        raise EngineError(f"{onnx_path}: {e}") from None
    path = onnx_path.with_name(f"{graph}.trt.onnx")
    atomic_write(path, out.SerializeToString())
    return path


def _dim(expr: str):
    """A named ONNX dim ('batch', 'batch*tokens', 'past + tokens', ...) as a stand-in shape expression over a dict of
    the profile's named dims."""
    import re
    from k3export.trt_standin import Sym
    if not re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*|[A-Za-z_0-9 +*\-()]+", expr):
        raise EngineError(f"unsupported dim expression {expr!r} in the ONNX")
    code = compile(expr, "<dim>", "eval")
    return Sym(lambda env: eval(code, {"__builtins__": {}}, dict(env)))      # noqa: S307 (names and + - * only)


def plan_check(onnx_path: Path, dims: dict[str, int]) -> dict[str, dict]:
    """What a TensorRT build of a rewritten graph (`plugin_onnx`) does with its plugin nodes, without TensorRT: each
    node is built against its registration on the `tensorrt.plugin` stand-in (`k3export.trt_standin`, with the
    registration checks of TensorRT 11.4's plugin module), inputs described from the ONNX's shapes as expressions
    of the profile's named dims, outputs from the plugin's descriptor function (and checked against the ONNX's
    shape for that tensor where it has one), then its aot_impl run: the launch contract's PTX compiled for sm_90.
    `dims`: the named dims' values at which grids and shapes are evaluated (the profile's largest). Returns plugin
    -> {"nodes", "kernels", "max_shared_mem", "max_grid"}; EngineError names the first node that fails."""
    import onnx
    from onnx import helper
    from k3export.trt_standin import ev, standin
    model = onnx.load(str(onnx_path), load_external_data=False)
    with standin() as (trt, trtp):
        register_plugins()
        types = {onnx.TensorProto.FLOAT: trt.float32, onnx.TensorProto.FLOAT16: trt.float16,
                 onnx.TensorProto.BFLOAT16: trt.bfloat16, onnx.TensorProto.INT32: trt.int32,
                 onnx.TensorProto.INT64: trt.int64, onnx.TensorProto.FLOAT8E4M3FN: trt.DataType.FP8}
        known = {}
        for v in (*model.graph.input, *model.graph.value_info, *model.graph.output):
            tt = v.type.tensor_type
            known[v.name] = trtp.TensorDesc(tuple(_dim(d.dim_param) if d.dim_param else d.dim_value
                                                  for d in tt.shape.dim), types.get(tt.elem_type))
        for t in model.graph.initializer:
            known[t.name] = trtp.TensorDesc(tuple(t.dims), types.get(t.data_type))
        onnx_shapes = dict(known)
        plan: dict[str, dict] = {}
        for node in model.graph.node:
            if node.domain != "k3":
                continue
            name = f"k3::{node.op_type}"
            where = f"{onnx_path.name}: node {node.name} ({name})"
            if name not in trtp.registered:
                raise EngineError(f"{where}: no plugin registered under this name")
            fn, tensors, attr_types, n_out = trtp.registered[name]
            missing = [i for i in node.input if i not in known]
            if len(node.input) != len(tensors) or len(node.output) != n_out or missing:
                raise EngineError(f"{where}: {len(node.input)} inputs / {len(node.output)} outputs for the "
                                  f"registration's {len(tensors)} / {n_out}" + (f"; no shape for {missing}"
                                                                                if missing else ""))
            given = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "aot"}
            attrs = {a: attr_types[a](given[a]) for a in attr_types if a in given}
            if set(attrs) != set(attr_types):
                raise EngineError(f"{where}: attributes {sorted(given)}, the registration takes {sorted(attr_types)}")
            ins = [known[i] for i in node.input]
            try:
                outs = fn(*ins, **attrs)
                aot = trtp.aot[name]
                used = {a: v for a, v in attrs.items() if a in aot.__code__.co_varnames}
                kernel, ptx, params, _ = aot(*ins, **used, outputs=outs, tactic=0)
            except Exception as e:                                       # noqa: BLE001 (named and re-raised)
                raise EngineError(f"{where}: {type(e).__name__}: {e}") from None
            for o, desc in zip(node.output, outs):
                ref = onnx_shapes.get(o)
                if ref is not None and ([ev(x, dims) for x in ref.shape_expr] != [ev(x, dims) for x in desc.shape_expr]
                                        or ref.dtype != desc.dtype):
                    raise EngineError(f"{where}: output {o} would be {[ev(x, dims) for x in desc.shape_expr]} "
                                      f"{desc.dtype}, the ONNX has {[ev(x, dims) for x in ref.shape_expr]} {ref.dtype}")
                known[o] = desc
            grid = tuple(ev(g, dims) for g in (params.grid_x, params.grid_y, params.grid_z))
            rec = plan.setdefault(node.op_type, {"nodes": 0, "kernels": [], "max_shared_mem": 0, "max_grid": grid})
            rec["nodes"] += 1
            if kernel not in rec["kernels"]:
                rec["kernels"].append(kernel)
            rec["max_shared_mem"] = max(rec["max_shared_mem"], params.shared_mem)
            rec["max_grid"] = max(rec["max_grid"], grid, key=lambda g: g[0] * g[1] * g[2])
            if ".target sm_90" not in ptx:
                raise EngineError(f"{where}: its PTX does not target sm_90")
    return plan


def dry_run(graphs, scales_sha256: str | None = None, echo=print) -> Path:
    """`build --backend tensorrt --dry-run`: everything of the TensorRT build up to TensorRT itself, for the ONNX
    graphs of an export directory: each graph rewritten into plugin nodes (`<graph>.trt.onnx` beside it), no node
    left that no plugin takes (`plugin_gaps`), and every plugin node built and compiled (`plan_check`) at the
    profile the build would use (`build_aoti.profiles_from_dims`). Writes `trt-plan.json` there; returns its path."""
    import json
    from k3export.build_aoti import profiles_from_dims
    from k3export.manifest import atomic_write, load_manifest
    if graphs is None:
        raise EngineError("--dry-run checks the ONNX graphs of an export directory: pass --graphs DIR")
    graphs = Path(graphs)
    try:
        gm = load_manifest(graphs)
    except ValueError as e:
        raise EngineError(str(e)) from None
    if scales_sha256:
        check_fp8_backend("tensorrt", graphs, scales_sha256)           # FP8 graphs of these scales
    quant = gm.get("quant")
    precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[gm["dtype"]]
    manifest = {"config": gm["config"], "config_hash": gm["config_hash"], "precision": precision,
                "quant": quant if quant else None}
    gm, files = onnx_inputs(graphs, manifest)
    profiles = profiles_from_dims(gm)
    report = {"graphs": str(graphs), "precision": precision, "fp8": bool(quant), "profiles": profiles, "plugins": {}}
    for g in GRAPHS:
        path = plugin_onnx(files[g], g, manifest, profiles)
        gaps = plugin_gaps(path)
        if gaps:
            raise EngineError(f"{path}: TensorRT cannot take these k3 nodes: "
                              + "; ".join(f"{op}: {why}" for op, why in gaps.items()))
        dims = {d: v[2] for d, v in profiles[g].items()}
        plan = plan_check(path, dims)
        report["plugins"][g] = plan
        echo(f"{g}: {path.name}, {sum(r['nodes'] for r in plan.values())} plugin nodes at {dims}")
        for op, r in plan.items():
            echo(f"  k3::{op:20s} x{r['nodes']:<3d} {', '.join(r['kernels'])}  smem {r['max_shared_mem']} B, "
                 f"largest grid {r['max_grid']}")
    out = graphs / "trt-plan.json"
    atomic_write(out, json.dumps(report, indent=2) + "\n")
    return out


def register_plugins() -> list[str]:
    """Register the `tensorrt.plugin` definitions of every `plugins/<op>/trt*.py` (each module's
    `register_plugins()`: importing one registers nothing); returns the modules that registered."""
    done = []
    for name in PLUGIN_MODULES:
        module = importlib.import_module(f"k3export.plugins.{name}")
        if module.register_plugins():
            done.append(name)
    return done


def onnx_inputs(graphs, manifest: dict) -> tuple[dict, dict[str, Path]]:
    """The graph manifest of `graphs` (checked against the engine's config) and its ONNX file per graph, as the
    manifest's `onnx` entry names them; EngineError when the directory does not fit or a file is missing."""
    from k3export.manifest import check_manifest, load_manifest
    if graphs is None:
        raise EngineError("--backend tensorrt needs --graphs DIR holding prefill.onnx/decode.onnx "
                          "(run `k3export export` then `k3export onnx`)")
    graphs = Path(graphs)
    try:
        gm = load_manifest(graphs)
        check_manifest(gm, config_hash=manifest["config_hash"])
    except ValueError as e:
        raise EngineError(str(e)) from None
    if "onnx" not in gm:
        raise EngineError(f"{graphs} has no ONNX graphs; run `k3export onnx --graphs {graphs}`")
    if gm.get("quant") and not manifest.get("quant"):
        raise EngineError(f"{graphs} holds FP8 graphs (scales {gm['quant'].get('scales')}): build with --scales "
                          "and that scales file")
    files = {g: graphs / gm["onnx"]["graphs"][g]["file"] for g in GRAPHS}
    missing = [str(f) for f in files.values() if not f.exists()]
    if missing:
        raise EngineError(f"{', '.join(missing)} missing; run `k3export onnx --graphs {graphs}`")
    return gm, files


def build_tensorrt(out: Path, graphs, manifest: dict, log) -> dict[str, str]:
    trt = import_tensorrt()
    from k3export.build_aoti import profiles_from_dims
    from k3export.manifest import atomic_write
    gm, onnx_files = onnx_inputs(graphs, manifest)
    manifest["profiles"] = profiles = profiles_from_dims(gm)
    log.note(f"plugins registered: {register_plugins()}")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    cache_path = out / TIMING_CACHE
    config0 = builder.create_builder_config()
    cache = config0.create_timing_cache(cache_path.read_bytes() if cache_path.exists() else b"")
    files = {}
    for g in GRAPHS:
        onnx_path = log.step(f"{g}: k3 nodes -> AOT plugin nodes", plugin_onnx, onnx_files[g], g, manifest,
                             profiles)
        gaps = plugin_gaps(onnx_path)
        if gaps:
            raise EngineError(f"{onnx_path}: TensorRT cannot take these k3 nodes yet: "
                              + "; ".join(f"{op}: {why}" for op, why in gaps.items()))
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(network, logger)
        if not log.step(f"{g}: parse ONNX", parser.parse_from_file, str(onnx_path)):
            errs = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise EngineError(f"TensorRT could not parse {onnx_path}: {'; '.join(errs[:5])}")
        config = builder.create_builder_config()
        config.set_timing_cache(cache, ignore_mismatch=False)
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile_shapes(gm["graphs"][g]["inputs"], profiles[g]).items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
        plan = log.step(f"{g}: build engine", builder.build_serialized_network, network, config)
        if plan is None:
            raise EngineError(f"TensorRT failed to build the {g} engine (see the TensorRT log above)")
        atomic_write(out / f"{g}.engine", bytes(plan))
        files[f"{g}.engine"] = f"{g}.engine"
    atomic_write(cache_path, bytes(cache.serialize()))
    return files


class TensorRTBackend:
    """Runs the serialized engines with torch-allocated buffers (the `runtime.Backend` interface)."""

    name = "tensorrt"

    def __init__(self, path: Path, manifest: dict, device: torch.device):
        trt = import_tensorrt()
        register_plugins()
        self.config = K3Config.from_dict(manifest["config"])
        self.dtype, self.device = PRECISIONS[manifest["precision"]], device
        self.max_prefill_tokens = manifest["profiles"]["prefill"]["tokens"][2]
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._ctx = {}
        for g in GRAPHS:
            engine = runtime.deserialize_cuda_engine((path / f"{g}.engine").read_bytes())
            if engine is None:
                raise EngineError(f"{path / (g + '.engine')} does not deserialize with TensorRT {trt.__version__}")
            self._ctx[g] = (engine, engine.create_execution_context())

    def _run(self, g: str, names: tuple[str, ...], args) -> tuple:
        from k3export.export import OUTPUTS
        engine, ctx = self._ctx[g]
        keep = [t.contiguous() for t in args]                  # alive until the launch is queued
        for name, t in zip(names, keep):
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        outs = []
        for name in OUTPUTS:
            shape = tuple(ctx.get_tensor_shape(name))
            dtype = {"FLOAT": torch.float32, "BF16": torch.bfloat16, "HALF": torch.float16,
                     "INT64": torch.int64}[engine.get_tensor_dtype(name).name]
            o = torch.empty(shape, dtype=dtype, device=self.device)
            ctx.set_tensor_address(name, o.data_ptr())
            outs.append(o)
        ctx.execute_async_v3(torch.cuda.current_stream().cuda_stream)
        return tuple(outs)

    def prefill(self, *args):
        from k3export.export import PREFILL_INPUTS
        return self._run("prefill", PREFILL_INPUTS, args)

    def decode(self, *args):
        from k3export.export import DECODE_INPUTS
        return self._run("decode", DECODE_INPUTS, args)
