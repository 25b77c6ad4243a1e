"""Inductor graph passes of the `compile` serving backend (`CompileBackend(mix_gemv=...)`).

`MixIntoGemv` rewrites the post-grad graph of a decode step: where `k3::attn_res_add_norm` (a sublayer's residual
add, AttnRes mix and the next RMSNorm, `model.packing.fuse_norms`) feeds a one-row `k3::gemv` (the next sublayer's
packed input projection, or the LM head, `model.packing.gemv_linears`), the two become one `k3::gemv_mix`, whose
CUDA kernel computes the mix inside every GEMV program after its PDL wait while the weights stream (one launch and
one round trip of x through memory fewer per sublayer). The op returns the add's partial sum, the normalised input
(for its other readers, e.g. the MoE router) and the GEMV's output, so every other node keeps its input.

Only graphs where the pattern is exact are changed: the GEMV reads the mix output itself (no view between), has at
most `max_rows` output rows, and its weight is a graph input (defined before the mix). The op checks its shapes at
run time and computes its reference (the two ops' composition) for anything its kernel does not take.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files


def _args(node: torch.fx.Node) -> list:
    """The node's arguments in schema order (positional or keyword in the graph)."""
    schema = node.target._schema
    return [node.args[i] if i < len(node.args) else node.kwargs[a.name] for i, a in enumerate(schema.arguments)]


class MixIntoGemv(CustomGraphPass):
    """`k3::attn_res_add_norm` -> `k3::gemv` on its normalised output => one `k3::gemv_mix` (module docstring).
    `fused` counts the rewrites of the graphs this instance has seen (tests, the backend's report)."""

    def __init__(self, max_rows: int):
        self.max_rows = int(max_rows)
        self.fused = 0

    def uuid(self):
        return (get_hash_for_files((__file__,)), self.max_rows)

    def __call__(self, graph: torch.fx.Graph) -> None:
        import k3export.plugins.gemv.op  # noqa: F401  (registers k3::gemv_mix)
        mix_op, gemv_op = torch.ops.k3.attn_res_add_norm.default, torch.ops.k3.gemv.default
        order = {n: i for i, n in enumerate(graph.nodes)}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not mix_op:
                continue
            outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
            x = outs.get(1)
            gemv = None if x is None else next((u for u in x.users if u.target is gemv_op and u.args[0] is x
                                                and self._fits(u, order[node], order)), None)
            if gemv is None:
                continue
            w = _args(gemv)[1]
            with graph.inserting_before(node):
                fused = graph.call_function(torch.ops.k3.gemv_mix.default, (*_args(node), w))
                got = [graph.call_function(operator.getitem, (fused, i)) for i in range(3)]
            vals = (outs[0].meta["val"] if 0 in outs else x.meta["val"], x.meta["val"], gemv.meta["val"])
            fused.meta["val"] = vals
            for g, v in zip(got, vals):
                g.meta["val"] = v
            for old, new in ((outs.get(0), got[0]), (x, got[1]), (gemv, got[2])):
                if old is not None:
                    old.replace_all_uses_with(new)
            for old in (gemv, x, outs.get(0), node):
                if old is not None:
                    graph.erase_node(old)
            self.fused += 1
        graph.lint()

    def _fits(self, gemv: torch.fx.Node, at: int, order: dict) -> bool:
        x, w = _args(gemv)
        xv, wv = x.meta.get("val"), getattr(w, "meta", {}).get("val")
        return (isinstance(w, torch.fx.Node) and order.get(w, at) < at and xv is not None and wv is not None
                and xv.dim() == 2 and xv.shape[0] == 1 and wv.dim() == 2 and wv.shape[0] <= self.max_rows
                and wv.dtype == xv.dtype)
