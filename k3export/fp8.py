"""FP8 (E4M3) inference: quantized linears and expert banks that swap in after the model is built.

The model code never branches on precision: `quantize_model(model, scales)` replaces each `nn.Linear` named in a
scales file (written by `k3export calibrate`) with an `FP8Linear`, and each routed expert bank with FP8 storage
(`k3export.fp8_moe`). An FP8 GEMM is one op, `k3::fp8_linear`, whose contract (and the ONNX Q/DQ translation,
`k3export.fp8_onnx`) is the static-scale W8A8 GEMM

    y = (q(x / s_x) * s_x) @ (W_q * s_w)^T        q = round-to-nearest E4M3, saturating at +-448

Its default implementation (every device) is that dequantizing reference, `fp8_linear_ref`. Weights are stored
as float8_e4m3fn, never fake-quant. On CUDA the implementation depends on M (rows):

- M <= WEIGHT_ONLY_M (decode): WEIGHT-ONLY FP8 (W8A16), `fp8_kernels.fp8_linear_wo_fwd`: x is not quantized,
  the activation scale s_x is unused, and y = x @ (W_q * s_w)^T with fp32 accumulation (`fp8_linear_wo_ref`).
  Decode is bound by weight bytes, which this reads once at half the bf16 bytes, in one launch (two when K is
  split), without the activation-quantize launch; its error is the weight rounding alone, smaller than W8A8's.
  One-row calls run `plugins.gemv`'s kernel instead (same contract; `K3_FP8_GEMV=0` keeps the split-K GEMV).
- larger M (prefill): the contract above, run as a one-launch Triton quantization of x then `torch._scaled_mm`
  (tensor-wise scales, or row-wise when the weight scales are per output channel; K and N must be multiples of
  16, else the reference runs). Output rounding: tensor-wise GEMMs write x.dtype directly; row-wise GEMMs write
  bf16 and cast to x.dtype, because the row-wise `_scaled_mm` output dtypes depend on the torch build and GPU
  (CUTLASS path: bf16 only in older torch, bf16/fp16 in newer; fp32 only through cuBLAS >= 12.9 on SM90) and
  this was not re-measured on the H200: for an fp16 or fp32 model with per-channel weight scales the result
  carries one extra bf16 rounding (<= 2^-9 relative per element) versus the reference.

So on CUDA a decode step and a prefill of the same tokens differ by the activation rounding (E4M3: up to 2^-4
relative per element of x), and an exported engine (TensorRT, Q/DQ) quantizes activations at every M.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from k3export.plugins.kda.naive import acc_dtype

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0        # largest finite E4M3 value; casts beyond it give NaN, so quantize() saturates first


def scale_from_amax(amax: Tensor) -> Tensor:
    """fp32 scale s with amax / s = 448 (an all-zero tensor gets s = 1: any scale represents it)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale rounded to E4M3, saturating at +-448. scale broadcasts against x (fp32)."""
    return (x.to(acc_dtype(x)) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def weight_amax(w: Tensor, per_channel: bool) -> Tensor:
    """|w| max over the input dim: `[..., out]` per output channel, else one per matrix (`[...]`).
    w `[..., out, in]` (a stacked expert bank keeps its leading dims)."""
    a = w.detach().abs().amax(-1).float()
    return a if per_channel else a.amax(-1)


def dequant_weight(w: Tensor, w_scale: Tensor, dt: torch.dtype) -> Tensor:
    """w `[N, K]` fp8, w_scale `[N]` or `[]` -> `[N, K]` in dt."""
    s = w_scale.to(dt)
    return w.to(dt) * (s[:, None] if s.dim() else s)


def fp8_linear_ref(x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
    """The reference FP8 GEMM: quantize x, dequantize both, multiply in at least fp32. -> `[M, N]` in x.dtype."""
    dt = acc_dtype(x)
    xd = quantize(x, x_scale).to(dt) * x_scale.to(dt)
    return (xd @ dequant_weight(w, w_scale, dt).T).to(x.dtype)


def fp8_linear_wo_ref(x: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
    """The weight-only reference (CUDA at small M): x @ (W_q s_w)^T in at least fp32 -> `[M, N]` in x.dtype."""
    dt = acc_dtype(x)
    return (x.to(dt) @ dequant_weight(w, w_scale, dt).T).to(x.dtype)


@torch.library.custom_op("k3::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
    """FP8 GEMM with a static per-tensor activation scale.

    x `[M, K]` (any float dtype, quantized inside), x_scale `[]` fp32, w `[N, K]` float8_e4m3fn, w_scale `[N]`
    (per output channel) or `[]` fp32. Returns `[M, N]` in x.dtype; accumulation in fp32 (or wider).
    On CUDA with M <= WEIGHT_ONLY_M, x is not quantized (weight-only; x_scale unused): see the module docstring.
    """
    return fp8_linear_ref(x, x_scale, w, w_scale)


@fp8_linear.register_fake
def _(x, x_scale, w, w_scale):
    return x.new_empty(x.shape[0], w.shape[0])


def scaled_mm_ok(x: Tensor, w: Tensor) -> bool:
    """cuBLASLt FP8 needs K and N to be multiples of 16 (M is free)."""
    return x.shape[1] % 16 == 0 and w.shape[0] % 16 == 0


# Rows up to which CUDA runs the weight-only kernel instead of quantize + `torch._scaled_mm`. Measured on the H200
# (`k3export bench fp8` linear sweep, the 9 FP8 linear shapes of the full-width layer pair, CUDA-graph replays):
# summed over the shapes, weight-only 215 / 236 / 237 us at M = 1 / 4 / 16 vs W8A8 303 / 303 / 302 us (bf16
# 290 / 287 / 285 us); at M = 32 W8A8 wins (291 vs 379 us) and at 64 too (272 vs 530 us).
WEIGHT_ONLY_M = 16
# Set False (once, with a message) when a weight-only kernel fails to compile or launch on this GPU: the op then
# runs W8A8 at every M rather than stop a model (the kernels' own tests call them directly and do fail).
WEIGHT_ONLY_OK = {"linear": True, "experts": True}


def weight_only_unavailable(kind: str, e: Exception) -> None:
    WEIGHT_ONLY_OK[kind] = False
    print(f"k3export.fp8: weight-only {kind} kernel unavailable ({type(e).__name__}: {str(e)[:300]}); "
          "running W8A8 instead", flush=True)


def fp8_linear_scaled_mm(x: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
    """The W8A8 CUDA path: Triton quantization of x, then `torch._scaled_mm` (the reference if K or N % 16)."""
    from k3export.fp8_kernels import fp8_quant_fwd
    if not scaled_mm_ok(x, w):
        return fp8_linear_ref(x, x_scale, w, w_scale)
    xq, rows = fp8_quant_fwd(x, x_scale)
    if w_scale.dim() == 0:                                  # tensor-wise: any output dtype
        out_dt = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        return torch._scaled_mm(xq, w.t(), scale_a=x_scale.float().reshape(()), scale_b=w_scale.float(),
                                out_dtype=out_dt).to(x.dtype)
    # row-wise (per output channel): [M, 1] and [1, N] fp32 scales, bf16 output (see the module docstring)
    y = torch._scaled_mm(xq, w.t(), scale_a=rows, scale_b=w_scale.float().view(1, w.shape[0]),
                         out_dtype=torch.bfloat16)
    return y.to(x.dtype)


# One-row calls (decode at B = 1) on `k3::gemv`'s kernel with E4M3 weights (`plugins.gemv`: whole weight rows
# loaded before the PDL wait), the weight-only contract above, instead of the split-K weight-only GEMV (env
# K3_FP8_GEMV=0 goes back to it; read per call). H200, 2026-11-30 13:30-13:37 UTC: the 52 k3-small decode GEMVs
# chained in a CUDA graph (`scripts/gemv_pdl_probe.py --fp8`) 273.0 us split-K, 231.6 this kernel, 189.6 with PDL
# (floor 113); k3-small FP8 decode step at B = 1 under `compile` (`bench fp8 --compiled`) 0.886 -> 0.823 ms (bf16
# 0.811 / 0.812 in the same runs); its cuda test vs the weight-only reference passed (4 shapes).
def one_row_gemv() -> bool:
    return os.environ.get("K3_FP8_GEMV", "1") == "1"


def _fp8_gemv(x: Tensor, w: Tensor, w_scale: Tensor) -> Tensor | None:
    """The one-row weight-only FP8 GEMV on `plugins.gemv` (PDL flags as the switch gives them), or None when it
    does not take this call."""
    from k3export.plugins.gemv import kernels as G
    if x.shape[0] != 1 or not G.supported_fp8(x, w, w_scale):
        return None
    return G.gemv_fwd(x, w, w_scale=w_scale, **G.launch_flags(x))


@fp8_linear.register_kernel("cuda")
def _(x, x_scale, w, w_scale):
    if one_row_gemv():
        y = _fp8_gemv(x, w, w_scale)
        if y is not None:
            return y
    if 0 < x.shape[0] <= WEIGHT_ONLY_M and x.dtype in (torch.bfloat16, torch.float16, torch.float32) \
            and WEIGHT_ONLY_OK["linear"]:
        from k3export.fp8_kernels import fp8_linear_wo_fwd
        try:
            return fp8_linear_wo_fwd(x, w, w_scale)                          # weight-only: x_scale unused
        except Exception as e:                                                  # noqa: BLE001 (reported)
            weight_only_unavailable("linear", e)
    return fp8_linear_scaled_mm(x, x_scale, w, w_scale)


def fp8_linear_cols_ref(a: Tensor, b: Tensor, wa: Tensor, sa: Tensor, wb: Tensor, sb: Tensor) -> Tensor:
    """The reference of `k3::fp8_linear_cols`: both weight-only products in at least fp32, summed, rounded once to
    a.dtype."""
    dt = acc_dtype(a)
    return (a.to(dt) @ dequant_weight(wa, sa, dt).T + b.to(dt) @ dequant_weight(wb, sb, dt).T).to(a.dtype)


@torch.library.custom_op("k3::fp8_linear_cols", mutates_args=())
def fp8_linear_cols(a: Tensor, b: Tensor, wa: Tensor, sa: Tensor, wb: Tensor, sb: Tensor) -> Tensor:
    """Two weight-only FP8 linears whose outputs are summed, a `[M, KA]` @ (wa sa)^T + b `[M, KB]` @ (wb sb)^T ->
    `[M, N]` in a.dtype (serving, one decode row: the LatentMoE's up and shared down projections,
    `packing.Fp8Cols`; CUDA: one launch of `plugins.gemv`'s two-weight GEMV). One fp32 sum rounded once, where the
    two linears run apart round each output and then their sum (a rounding-level difference)."""
    return fp8_linear_cols_ref(a, b, wa, sa, wb, sb)


@fp8_linear_cols.register_fake
def _(a, b, wa, sa, wb, sb):
    return a.new_empty((*a.shape[:-1], wa.shape[0]))


@fp8_linear_cols.register_kernel("cuda")
def _(a, b, wa, sa, wb, sb):
    from k3export.plugins.gemv import kernels as G
    if not G.cols_supported(a, b, wa, sa, wb, sb):
        return fp8_linear_cols_ref(a, b, wa, sa, wb, sb)
    return G.gemv_cols_fwd(a, b, wa, sa, wb, sb, **G.launch_flags(a))


class FP8Linear(nn.Module):
    """Drop-in for a bias-free `nn.Linear`: E4M3 weight `[out, in]`, fp32 weight scale (`[out]` or `[]`) and a
    static fp32 input scale, all buffers (they travel with `state_dict`, `.to()` and export)."""

    def __init__(self, in_features: int, out_features: int, per_channel: bool = True, out_dtype=torch.bfloat16,
                 device=None):
        super().__init__()
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.ones((out_features,) if per_channel else (), device=device))
        self.register_buffer("input_scale", torch.ones((), device=device))

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, input_scale: Tensor, weight_scale: Tensor) -> "FP8Linear":
        if linear.bias is not None:
            raise ValueError("FP8Linear covers the bias-free linears of K3; this one has a bias")
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, per_channel=weight_scale.dim() == 1, out_dtype=w.dtype,
                device=w.device)
        m.weight_scale.copy_(weight_scale.float())
        m.input_scale.copy_(input_scale.float().reshape(()))
        ws = m.weight_scale[:, None] if m.weight_scale.dim() else m.weight_scale
        m.qweight.copy_(quantize(w, ws))
        return m

    @property
    def weight(self) -> Tensor:
        """The dequantized weight `[out, in]` in the original dtype, for code that reads a weight as a matrix."""
        return dequant_weight(self.qweight, self.weight_scale, acc_dtype(self.input_scale)).to(self.out_dtype)

    def forward(self, x: Tensor) -> Tensor:
        """x `[..., in]` -> `[..., out]` in x.dtype."""
        y = fp8_linear(x.reshape(-1, self.in_features), self.input_scale, self.qweight, self.weight_scale)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        g = "per-channel" if self.weight_scale.dim() else "per-tensor"
        return f"in={self.in_features}, out={self.out_features}, e4m3 weights ({g}), static input scale"


def quantized_modules(scales: dict[str, Tensor]) -> dict[str, str]:
    """Module name -> kind ('linear' or 'experts') for every module a scales file covers."""
    out = {}
    for key in scales:
        name, _, leaf = key.rpartition(".")
        if leaf == "weight_scale":
            out[name] = "linear"
        elif leaf == "w13_scale":
            out[name] = "experts"
    return out


@torch.no_grad()
def quantize_model(model: nn.Module, scales: dict[str, Tensor]) -> dict[str, int]:
    """Swap, in place, every module named in `scales` (a `k3export calibrate` scales file) for its FP8 form.
    Returns counts {'linear': n, 'experts': n}. Raises KeyError naming a module the model lacks."""
    from k3export.fp8_moe import quantize_latent_moe
    from k3export.model.packing import unpack_projections
    unpack_projections(model)                  # packed GEMMs would keep reading the bf16 weights; re-pack after
    counts = {"linear": 0, "experts": 0}
    mods = dict(model.named_modules())
    for name, kind in quantized_modules(scales).items():
        if name not in mods:
            raise KeyError(f"the scales file names module '{name}', which this model does not have "
                           "(scales calibrated for another config?)")
        dev = mods[name].parameters().__next__().device if kind == "experts" else mods[name].weight.device
        s = {k[len(name) + 1:]: v.to(dev) for k, v in scales.items() if k.startswith(name + ".")}
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if kind == "linear":
            setattr(parent, attr, FP8Linear.from_linear(mods[name], s["input_scale"], s["weight_scale"]))
        else:
            quantize_latent_moe(parent, s)
        counts[kind] += 1
    return counts
