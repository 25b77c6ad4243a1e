"""The FP8 accuracy report: an FP8 model against its high-precision twin on held-out inputs.

Figures (all on the same held-out token ids, fresh prefill):
- logits: cosine similarity per position (mean and min), KL(p_ref || p_fp8) per position (mean, max),
  top-1 agreement;
- greedy generation from held-out prompts: tokens identical position by position, and the first divergence;
- per layer: the *local* relative error of the attention and of the channel mixer (the FP8 module fed the
  reference's own input, so upstream error is excluded) and the relative error of the hidden state entering
  each layer (accumulated); the worst layer is the one with the largest local error.
The reference is usually the bf16 model; `noise_floor` runs the same figures for another precision pair (e.g.
bf16 vs fp32) so that a number can be read against the model's own sensitivity.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3export.generate import generate


def rel_err(a: Tensor, ref: Tensor) -> float:
    ref = ref.double()
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def logit_metrics(lf: Tensor, lr: Tensor) -> dict:
    """lf, lr `[N, V]` logits (test, reference)."""
    lf, lr = lf.double(), lr.double()
    cos = torch.nn.functional.cosine_similarity(lf, lr, dim=-1)
    kl = (torch.softmax(lr, -1) * (torch.log_softmax(lr, -1) - torch.log_softmax(lf, -1))).sum(-1)
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()), "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()), "top1_agreement": float((lf.argmax(-1) == lr.argmax(-1)).double().mean()),
            "positions": int(lf.shape[0])}


def _capture(model: nn.Module) -> tuple[dict, list]:
    """Forward hooks storing each layer's attention input (input_layernorm output) and the channel mixer's input
    and output (post_attention_layernorm output, mlp/block_sparse_moe output)."""
    rec: dict = {}
    hooks = []
    for layer in model.model.layers:
        i = layer.index
        mixer = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
        hooks.append(layer.input_layernorm.register_forward_hook(
            lambda m, a, o, i=i: rec.__setitem__((i, "attn_in"), o.detach())))
        hooks.append(layer.post_attention_layernorm.register_forward_hook(
            lambda m, a, o, i=i: rec.__setitem__((i, "mix_in"), o.detach())))
        hooks.append(mixer.register_forward_hook(lambda m, a, o, i=i: rec.__setitem__((i, "mix_out"), o.detach())))
    return rec, hooks


def _attention(model: nn.Module, layer: int, x: Tensor) -> Tensor:
    """One layer's token mixer on x `[B, T, d]` from a fresh state (what a fresh prefill runs)."""
    att = model.model.layers[layer].self_attn
    B, T, _ = x.shape
    st = model.new_state(B, T)
    if model.model.layers[layer].is_mla:
        y, _ = att.prefill(x, st.mla_cache[0, :, :0], torch.zeros(B, dtype=torch.int64, device=x.device))
    else:
        lengths = torch.full((B,), T, dtype=torch.int64, device=x.device)
        y, _, _ = att.prefill(x, lengths, st.kda_conv[0], st.kda_state[0])
    return y


@torch.no_grad()
def accuracy_report(test: nn.Module, ref: nn.Module, ids: Tensor, gen_prompts: list[list[int]],
                    gen_tokens: int) -> dict:
    """test/ref: two K3Models with the same config (e.g. FP8 and bf16). ids `[B, T]` held-out token ids."""
    ids = ids.to(ref.device)
    rec_r, hr = _capture(ref)
    rec_t, ht = _capture(test)
    try:
        lr, lt = ref(ids), test(ids)
    finally:
        for h in hr + ht:
            h.remove()
    B, T = ids.shape
    layers = []
    for layer in ref.model.layers:
        i = layer.index
        x_att = rec_r[(i, "attn_in")].view(B, T, -1)                  # the reference's input, in each dtype
        att_ref, att_test = _attention(ref, i, x_att), _attention(test, i, x_att.to(test.dtype))
        mix_in = rec_r[(i, "mix_in")].to(test.dtype)
        mixer = test.model.layers[i].channel_mixer
        layers.append({
            "layer": i, "kind": ("MLA" if layer.is_mla else "KDA") + ("+MLP" if hasattr(layer, "mlp") else "+MoE"),
            "attn_local": rel_err(att_test, att_ref),
            "mixer_local": rel_err(mixer(mix_in), rec_r[(i, "mix_out")]),
            "hidden_in": rel_err(rec_t[(i, "attn_in")], rec_r[(i, "attn_in")]),
        })
    worst = max(layers, key=lambda r: max(r["attn_local"], r["mixer_local"]))
    out_r = generate(ref, gen_prompts, gen_tokens)
    out_t = generate(test, gen_prompts, gen_tokens)
    same = sum(a == b for r, t in zip(out_r, out_t) for a, b in zip(r, t))
    total = sum(len(r) for r in out_r)
    first = [next((j for j, (a, b) in enumerate(zip(r, t)) if a != b), len(r)) for r, t in zip(out_r, out_t)]
    return {
        "logits": logit_metrics(lt.reshape(-1, lt.shape[-1]), lr.reshape(-1, lr.shape[-1])),
        "greedy": {"tokens_per_prompt": gen_tokens, "prompts": len(gen_prompts), "agreement": same / max(total, 1),
                   "first_divergence": first},
        "layers": layers,
        "worst_layer": {"layer": worst["layer"], "kind": worst["kind"],
                        "part": "attention" if worst["attn_local"] >= worst["mixer_local"] else "channel mixer",
                        "rel_err": max(worst["attn_local"], worst["mixer_local"])},
    }


def format_report(rep: dict, title: str = "FP8 vs bf16") -> str:
    lg, gr, w = rep["logits"], rep["greedy"], rep["worst_layer"]
    lines = [f"accuracy report: {title}",
             f"  logits ({lg['positions']} held-out positions): cosine mean {lg['cosine_mean']:.5f} "
             f"(min {lg['cosine_min']:.5f}), KL mean {lg['kl_mean']:.3e} (max {lg['kl_max']:.3e}), "
             f"top-1 agreement {lg['top1_agreement']:.4f}",
             f"  greedy, {gr['prompts']} prompt(s) x {gr['tokens_per_prompt']} tokens: agreement "
             f"{gr['agreement']:.4f}, first divergence at {gr['first_divergence']}",
             "  per layer (relative error): local attention / local channel mixer / hidden state entering"]
    for r in rep["layers"]:
        lines.append(f"    layer {r['layer']:3d} {r['kind']:8s} {r['attn_local']:.3e} / {r['mixer_local']:.3e} / "
                     f"{r['hidden_in']:.3e}")
    lines.append(f"  worst layer: {w['layer']} ({w['kind']}, {w['part']}), local rel. error {w['rel_err']:.3e}")
    return "\n".join(lines)


@torch.no_grad()
def onnx_oracle(fp8_model: nn.Module, x: Tensor, workdir) -> dict:
    """Export layer 0's FP8 channel mixer (the dense SituMLP: three FP8 linears) as a Q/DQ ONNX graph, reload it
    from disk and run it with onnxruntime (CPU) against the eager FP8 module on the same fp32 input x `[N, d]`."""
    import copy
    from pathlib import Path

    import onnx

    from k3export.fp8_onnx import export_qdq, qdq_census, run_onnx
    layer = fp8_model.model.layers[0]
    mixer = copy.deepcopy(layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe.shared_experts).cpu()
    x = x.detach().float().cpu()
    path = export_qdq(mixer, (x,), Path(workdir) / "layer0_mixer_fp8.onnx")
    (y_ort,) = run_onnx(path, x)
    y = mixer(x)
    census = qdq_census(onnx.load(str(path)))
    return {"graph": str(path), "rel_err": rel_err(y_ort, y), "QuantizeLinear": census["QuantizeLinear"],
            "DequantizeLinear": census["DequantizeLinear"], "fp8_weights": len(census["fp8_weights"])}
