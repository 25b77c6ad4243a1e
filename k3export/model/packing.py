"""Packing: linears that share an input (or whose outputs are summed) run as one GEMM, a swap after the model is
built.

At one decode token every projection is a GEMV whose time is mostly launch and ramp: on the H200 (k3-small,
B = 1, 2026-11-30) KDA's six input projections take 34.9 us as six cuBLAS calls and 11.6 us as one call on the
concatenated weight. `pack_projections` concatenates, per module:

- KDA: q | k | v | g | f_a | b (one input x) -> q|k|v, g, f_a(x), beta logits; and the q|k|v short-conv
  kernels, which `conv_weight()` otherwise concatenates on every call;
- MLA: q_a | kv_a | g;
- LatentMoE: the routed down projection | shared gate | shared up (one input x), and the two output projections
  as one GEMM over concatenated inputs: up(RMSNorm(u)) + shared_down(h) = [W_up | W_down] [RMSNorm(u); h];
- the dense SiTU MLP: gate | up.

Each member's weight becomes a view of the packed tensor, so parameter names, `state_dict`, checkpoints and
memory are unchanged, and the unpacked methods still compute the same values. The packed module shadows the
owner's `project` / `output` method in the instance `__dict__` (it is not a registered child, so it adds no
parameter); `unpack_projections` removes it. Pack after the last `.to()` (a move copies each member separately;
`K3Model._apply` unpacks, so a moved or cast model runs unpacked) and after FP8 quantization
(`fp8.quantize_model` unpacks first). FP8 linears pack when their input scales agree (they read the same tensor,
so calibration gives equal scales), and a group whose recipe keeps some members in bf16 becomes one GEMM per run
of one kind; column packing is bf16/fp32 only, since its two inputs would need one input scale.

`pair_experts` changes a layout, not a method: each expert bank's w1 / w3 become the even / odd rows of one tensor,
which the MoE prefill kernel reads as one weight tile (`unpair_experts` undoes it).

With `glu=True` the SiTU-GLU projections (the MoE's down | shared gate | shared up, the dense MLP's gate | up)
pack with gate / up rows interleaved instead, as `PackedGlu` swapped for the owner's `project_hidden` / `hidden`,
so a one-row call can apply the activation in the GEMV's epilogue (`k3::gemv_glu`).

With `fold_norm=True` the LatentMoE's latent RMSNorm joins its packed output GEMM (`NormCols`, swapped for
`norm_output`): a one-row call runs `k3::gemv_norm`, whose programs normalise u while they read [u | h].

`gemv_linears` changes a class, not a method: each bias-free `nn.Linear` (the packed ones included) becomes a
`GemvLinear`, whose one-row calls on CUDA (a decode step at B = 1) run `k3::gemv` (`plugins.gemv`: whole weight
rows in registers, loaded before the PDL wait) instead of cuBLAS; every other call is `F.linear` as before.

`fuse_norms`, the other serving swap here, replaces `K3Model.mix_norm` (AttnRes mix, then the RMSNorm that reads
it) by one `k3::attn_res_norm` launch and `K3Model.add_mix_norm` (the residual add before them too) by one
`k3::attn_res_add_norm` launch; `unpack_projections` and `unpacked` cover them too.

Numerics: a row-packed GEMM computes each output exactly as its member does (same dot products; cuBLAS may pick
another kernel, measured equal on the H200); the column-packed output is one fp32 accumulation rounded once
instead of two rounded outputs added (a rounding-level difference, e.g. 2.8e-3 relative in bf16).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from k3export.plugins.attn_res.op import attn_res_add_norm, attn_res_norm

# the owners' methods that packs shadow
PROJECTION_SWAPS = ("project", "output", "conv_weight", "project_hidden", "hidden", "norm_output")
SWAPPED = PROJECTION_SWAPS + ("mix_norm", "add_mix_norm")   # ... and every serving swap


class PackedLinear(nn.Module):
    """One bias-free linear standing for several. `splits` set: rows packed, `forward(x)` returns the members'
    outputs (`split` along the last dim, groups of members merged as the owner asked). `splits` None: columns
    packed, `forward(*xs)` returns the sum of the members' outputs on their own inputs."""

    def __init__(self, linear: nn.Module, splits: list[int] | None):
        super().__init__()
        self.linear, self.splits = linear, splits

    def forward(self, *xs: torch.Tensor):
        if self.splits is None:
            return self.linear(torch.cat(xs, dim=-1))
        return self.linear(xs[0]).split(self.splits, dim=-1)

    def extra_repr(self) -> str:
        return f"rows, outputs {self.splits}" if self.splits is not None else "columns, inputs concatenated"


class PackedTensor(nn.Module):
    """A concatenation the owner would otherwise rebuild on every call; `forward()` returns it."""

    def __init__(self, t: torch.Tensor):
        super().__init__()
        self.t = t

    def forward(self) -> torch.Tensor:
        return self.t


@torch.no_grad()
def _pack_conv(kda: nn.Module) -> PackedTensor:
    """KDA's q|k|v depthwise kernels `[3HK, 1, W]` as one tensor; each conv's weight becomes a view of it."""
    convs = [kda.q_conv1d, kda.k_conv1d, kda.v_conv1d]
    w = torch.cat([c.weight for c in convs])
    for c, (a, b) in zip(convs, _ranges([c.weight.shape[0] for c in convs])):
        c.weight = nn.Parameter(w[a:b], requires_grad=False)
    return PackedTensor(w.squeeze(1))


def _kind(members: list[nn.Module]) -> str | None:
    from k3export.fp8 import FP8Linear
    if all((type(m) is nn.Linear or type(m) is GemvLinear) and m.bias is None for m in members):
        return "linear"
    if all(isinstance(m, FP8Linear) for m in members):
        return "fp8"
    return None


@torch.no_grad()
def _pack_rows(members: list[nn.Module], merge: list[int] | None = None) -> nn.Module | None:
    """Concatenate the members' weights along the output dim; each member's weight becomes a view of the result.
    `merge` groups consecutive members into one output (e.g. [3, 1] -> q|k|v together, then g). Members of two
    kinds (an FP8 model keeps some linears in bf16 by recipe, e.g. KDA's f_a and b) pack as one GEMM per run of
    one kind (`PackedRuns`). None when that is impossible (a merged output across two kinds, FP8 input scales or
    weight granularities that differ, different input widths)."""
    merge = merge or [1] * len(members)
    runs: list[tuple[str, list[list[nn.Module]]]] = []           # (kind, merged groups), in member order
    i = 0
    for n in merge:
        group = members[i:i + n]
        i += n
        kind = _kind(group)
        if kind is None:
            return None
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(group)
        else:
            runs.append((kind, [group]))
    if len({m.in_features for m in members}) != 1 or not all(_packable(k, sum(gs, [])) for k, gs in runs):
        return None
    parts = [_pack_run(kind, groups) for kind, groups in runs]
    return parts[0] if len(parts) == 1 else PackedRuns(parts)


def _packable(kind: str, members: list[nn.Module]) -> bool:
    first = members[0]
    name = "weight" if kind == "linear" else "qweight"
    ref = getattr(first, name)
    if any(getattr(m, name).dtype != ref.dtype or getattr(m, name).device != ref.device for m in members):
        return False                                      # torch.cat would promote or fail: leave them apart
    if kind == "linear":
        return True
    if any(m.weight_scale.dim() != first.weight_scale.dim() or m.out_dtype != first.out_dtype or
           not torch.equal(m.input_scale, first.input_scale) for m in members):
        return False
    # per-tensor weight scales must agree: the packed GEMM has one
    return bool(first.weight_scale.dim()) or all(torch.equal(m.weight_scale, first.weight_scale) for m in members)


def _pack_run(kind: str, groups: list[list[nn.Module]]) -> PackedLinear:
    members = sum(groups, [])
    sizes = [m.out_features for m in members]
    splits = [sum(m.out_features for m in g) for g in groups]
    if kind == "linear":
        w = torch.cat([m.weight for m in members])
        packed = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        packed.weight = nn.Parameter(w, requires_grad=False)
        for m, (a, b) in zip(members, _ranges(sizes)):
            m.weight = nn.Parameter(w[a:b], requires_grad=False)
        return PackedLinear(packed, splits)
    from k3export.fp8 import FP8Linear
    first = members[0]
    qw = torch.cat([m.qweight for m in members])
    ws = torch.cat([m.weight_scale for m in members]) if first.weight_scale.dim() else None   # per channel
    packed = FP8Linear(qw.shape[1], qw.shape[0], per_channel=ws is not None, out_dtype=first.out_dtype,
                       device="meta")
    packed.qweight = qw
    packed.weight_scale = ws if ws is not None else first.weight_scale.clone()
    packed.input_scale = first.input_scale.clone()
    for m, (a, b) in zip(members, _ranges(sizes)):
        m.qweight = qw[a:b]
        if ws is not None:
            m.weight_scale = ws[a:b]
    return PackedLinear(packed, splits)


class PackedRuns(nn.Module):
    """Row-packed GEMMs over one input, one per run of members of one kind; their outputs in member order."""

    def __init__(self, parts: list[PackedLinear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor):
        return tuple(y for part in self.parts for y in part(x))


class PackedGlu(nn.Module):
    """One GEMM for a projection followed by SiTU-GLU: the weight is [plain rows | gate_0, up_0, gate_1, up_1, ...]
    (LatentMoE: the routed down projection, then the shared experts' gate / up pairs; SituMLP: only the pairs).
    `forward(x)` returns (z, h) (`plain` True, for `LatentMoE.project_hidden`) or h (for `SituMLP.hidden`), h in
    x.dtype. A one-row CUDA call of a `GemvLinear` (`gemv_linears`) runs `k3::gemv_glu`: the activation in the
    GEMV's epilogue, from the fp32 sums (one launch, not two); otherwise one F.linear, then the activation on the
    rounded gate / up, as the unpacked owner computes it."""

    def __init__(self, linear: nn.Module, n_plain: int, beta: float, linear_beta: float, plain: bool):
        super().__init__()
        self.linear, self.n_plain, self.plain = linear, n_plain, plain
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor):
        w = self.linear.weight
        if type(self.linear) is GemvLinear and x.is_cuda and x.numel() == x.shape[-1]:
            from k3export.plugins.gemv.kernels import glu_supported
            if glu_supported(x, w, self.n_plain):
                z, h = torch.ops.k3.gemv_glu(x, w, self.n_plain, self.beta, self.linear_beta)
                return (z, h) if self.plain else h
        from k3export.plugins.moe.naive import situ_glu
        y = self.linear(x)
        gu = y[..., self.n_plain:].unflatten(-1, (-1, 2))
        h = situ_glu(gu[..., 0], gu[..., 1], self.beta, self.linear_beta).to(x.dtype)
        return (y[..., :self.n_plain], h) if self.plain else h

    def extra_repr(self) -> str:
        return f"{self.n_plain} plain rows, then gate/up pairs -> SiTU-GLU"


class NormCols(nn.Module):
    """`LatentMoE.norm_output(u, h)` = output(norm(u), h) over its column-packed output GEMM ([up | shared down]).
    A one-row CUDA call of a `GemvLinear` runs `k3::gemv_norm`: every GEMV program normalises u itself (the RMSNorm
    launch before it goes); otherwise the norm, then the packed GEMM, as the owner computes them."""

    def __init__(self, packed: PackedLinear, norm: nn.Module):
        super().__init__()
        self.packed, self.norm = packed, norm

    def forward(self, u: torch.Tensor, h: torch.Tensor):
        lin = self.packed.linear
        if type(lin) is GemvLinear and u.is_cuda and u.numel() == u.shape[-1]:
            from k3export.plugins.gemv.kernels import norm_supported
            if norm_supported(u, h, lin.weight, self.norm.weight):
                return torch.ops.k3.gemv_norm(u, h, lin.weight, self.norm.weight, self.norm.eps)
        return self.packed(self.norm(u), h)

    def extra_repr(self) -> str:
        return "RMSNorm of the first input inside the one-row GEMM"


@torch.no_grad()
def _pack_glu(plain: list[nn.Module], gate: nn.Module, up: nn.Module, beta: float, linear_beta: float,
              with_plain: bool) -> PackedGlu | None:
    """[plain members | gate / up rows interleaved] as one weight; the members' weights become views of it (gate
    and up: every other row, a row stride of 2 K). None when the members are not all bias-free bf16/fp32 linears
    of one input width, dtype and device (e.g. an FP8 recipe quantized some)."""
    members = plain + [gate, up]
    if _kind(members) != "linear" or len({m.in_features for m in members}) != 1 or not _packable("linear", members) \
            or gate.out_features != up.out_features:
        return None
    I, K = gate.weight.shape
    pairs = torch.stack([gate.weight, up.weight], dim=1).reshape(2 * I, K)
    w = torch.cat([m.weight for m in plain] + [pairs])
    n_plain = sum(m.out_features for m in plain)
    packed = nn.Linear(K, w.shape[0], bias=False, device="meta")
    packed.weight = nn.Parameter(w, requires_grad=False)
    for m, (a, b) in zip(plain, _ranges([m.out_features for m in plain])):
        m.weight = nn.Parameter(w[a:b], requires_grad=False)
    inter = w[n_plain:].view(I, 2, K)
    gate.weight = nn.Parameter(inter[:, 0], requires_grad=False)
    up.weight = nn.Parameter(inter[:, 1], requires_grad=False)
    return PackedGlu(packed, n_plain, beta, linear_beta, with_plain)


@torch.no_grad()
def _pack_cols(members: list[nn.Module]) -> PackedLinear | None:
    """Concatenate bias-free linears with one output width along the input dim (their outputs are summed)."""
    if _kind(members) != "linear" or len({m.out_features for m in members}) != 1 or not _packable("linear", members):
        return None
    w = torch.cat([m.weight for m in members], dim=1)
    packed = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    packed.weight = nn.Parameter(w, requires_grad=False)
    for m, (a, b) in zip(members, _ranges([m.in_features for m in members])):
        m.weight = nn.Parameter(w[:, a:b], requires_grad=False)
    return PackedLinear(packed, None)


def _ranges(sizes: list[int]):
    a = 0
    for n in sizes:
        yield a, a + n
        a += n


class FusedMixNorm(nn.Module):
    """`K3Model.mix_norm` (op `k3::attn_res_norm`: the AttnRes mix and the RMSNorm after it) or
    `K3Model.add_mix_norm` (op `k3::attn_res_add_norm`: the residual add before them too) as one launch. Called
    as the model calls the method: (bank, p[, y], res_norm, res_query, norm). Holds plain data only (a deep copy
    of a swapped model must work)."""

    def __init__(self, eps: float, add: bool):
        super().__init__()
        self.eps, self.add = eps, add

    def forward(self, bank, *args):
        *ps, res_norm, res_query, norm = args
        op = attn_res_add_norm if self.add else attn_res_norm
        return op(bank, *ps, res_norm.weight, res_query.weight, self.eps, norm.weight, norm.eps)


class Fp8Cols(nn.Module):
    """`LatentMoE.output(u, h)` = up(u) + shared_down(h) when both are `FP8Linear`s (column packing is bf16/fp32
    only): a one-row CUDA call runs `k3::fp8_linear_cols` (both weight-only GEMVs and the add in one launch,
    `plugins.gemv`'s two-weight kernel); otherwise the two linears and the add, as the owner computes them."""

    def __init__(self, up: nn.Module, down: nn.Module):
        super().__init__()
        self.up, self.down = up, down

    def forward(self, u: torch.Tensor, h: torch.Tensor):
        if u.is_cuda and u.numel() == u.shape[-1] and h.numel() == h.shape[-1]:
            from k3export.fp8 import fp8_linear_cols
            return fp8_linear_cols(u.reshape(1, -1), h.reshape(1, -1), self.up.qweight, self.up.weight_scale,
                                   self.down.qweight, self.down.weight_scale).view(*u.shape[:-1], -1)
        return self.up(u) + self.down(h)

    def extra_repr(self) -> str:
        return "two weight-only FP8 linears and their sum in one launch at one decode row"


def _fp8_cols(up: nn.Module, down: nn.Module) -> Fp8Cols | None:
    from k3export.fp8 import FP8Linear
    if isinstance(up, FP8Linear) and isinstance(down, FP8Linear) and up.out_features == down.out_features \
            and up.out_dtype == down.out_dtype:
        return Fp8Cols(up, down)
    return None


PACKED = (PackedLinear, PackedRuns, PackedTensor, FusedMixNorm, PackedGlu, NormCols, Fp8Cols)


def _swap(owner: nn.Module, method: str, packed: nn.Module | None) -> int:
    if packed is None:
        return 0
    owner.__dict__[method] = packed          # shadows the class method; not a registered child
    return 1


def pack_projections(model: nn.Module, glu: bool = False, fold_norm: bool = False,
                     fp8_cols: bool = False) -> int:
    """Pack every group listed in the module docstring, in place. Returns the number of packed groups (GEMMs and
    conv kernels; groups already packed are packed again from the current weights). `glu`: the LatentMoE's
    down | shared gate | shared up and the dense SiTU MLP's gate | up pack with gate / up rows interleaved, and
    the GEMM computes the activation too (`PackedGlu`, swapped for `project_hidden` / `hidden`). `fold_norm`: the
    LatentMoE's latent RMSNorm and its packed output GEMM as one `NormCols` (swapped for `norm_output`; at one decode
    row the GEMV normalises its input, `k3::gemv_norm`). `fp8_cols`: a LatentMoE whose up and shared down
    projections are both `FP8Linear`s (which do not column-pack) gets `Fp8Cols` for `output` (at one decode row
    one `k3::fp8_linear_cols` launch for the two GEMVs and their add; `CompileBackend`'s default)."""
    from k3export.model.kda import KimiDeltaAttention
    from k3export.model.layers import RMSNorm, SituMLP
    from k3export.model.mla import GatedMLA
    from k3export.model.moe import LatentMoE
    _remove_swaps(model, PROJECTION_SWAPS)
    shared = {id(m.shared_experts) for m in model.modules() if isinstance(m, LatentMoE)}   # packed with their MoE
    n = 0
    for mod in model.modules():
        if isinstance(mod, KimiDeltaAttention):
            n += _swap(mod, "project", _pack_rows([mod.q_proj, mod.k_proj, mod.v_proj, mod.g_proj, mod.f_a_proj,
                                                   mod.b_proj], merge=[3, 1, 1, 1]))
            n += _swap(mod, "conv_weight", _pack_conv(mod))
        elif isinstance(mod, GatedMLA):
            n += _swap(mod, "project", _pack_rows([mod.q_a_proj, mod.kv_a_proj_with_mqa, mod.g_proj]))
        elif isinstance(mod, LatentMoE) and mod.shared_experts is not None:
            s = mod.shared_experts
            g = _pack_glu([mod.routed_expert_down_proj], s.gate_proj, s.up_proj, s.beta, s.linear_beta,
                          with_plain=True) if glu else None
            n += _swap(mod, "project_hidden", g) if g is not None else \
                _swap(mod, "project", _pack_rows([mod.routed_expert_down_proj, s.gate_proj, s.up_proj]))
            cols = _pack_cols([mod.routed_expert_up_proj, s.down_proj])
            if cols is None and fp8_cols:
                cols = _fp8_cols(mod.routed_expert_up_proj, s.down_proj)
            n += _swap(mod, "output", cols)
            if fold_norm and isinstance(cols, PackedLinear) and isinstance(mod.routed_expert_norm, RMSNorm):
                _swap(mod, "norm_output", NormCols(cols, mod.routed_expert_norm))
        elif isinstance(mod, SituMLP) and id(mod) not in shared:
            g = _pack_glu([], mod.gate_proj, mod.up_proj, mod.beta, mod.linear_beta, with_plain=False) if glu else None
            n += _swap(mod, "hidden", g) if g is not None else _swap(mod, "project", _pack_rows([mod.gate_proj,
                                                                                                  mod.up_proj]))
    return n


def fuse_norms(model: nn.Module, adds: bool = True) -> int:
    """Swap `K3Model.mix_norm` for one `k3::attn_res_norm` launch per call (24 launches fewer per k3-small decode
    step; on by default in `CompileBackend`, whose bench backend `compile-unfused` leaves it off; H200 timings in
    the backend's docstring) and, with `adds`, `K3Model.add_mix_norm` for one `k3::attn_res_add_norm` launch
    (the residual add of the sublayer output too: the GEMM before it then runs without cuBLAS's add epilogue and
    its copy of p). Returns the number of swaps (0 for a model without `mix_norm`)."""
    if not hasattr(type(model), "mix_norm"):
        return 0
    n = _swap(model, "mix_norm", FusedMixNorm(model.config.rms_norm_eps, add=False))
    if adds and hasattr(type(model), "add_mix_norm"):
        n += _swap(model, "add_mix_norm", FusedMixNorm(model.config.rms_norm_eps, add=True))
    return n


@torch.no_grad()
def pair_experts(model: nn.Module) -> int:
    """Store each expert bank's w1 and w3 `[E, I, L]` as the even and odd rows of one tensor `[E, 2I, L]`
    (`interleave_gate_up`): the MoE prefill kernel then reads one weight tile per step for both and runs one dot
    of twice the width (H200, K3 shapes, 8192 tokens: its gemm1 17.96 -> 16.30 ms, bit-identical; docs/perf.md).
    The parameters become views of it: names, values, `state_dict` and memory are unchanged, `load_state_dict`
    writes into it; a `.to()` / cast (or `unpair_experts`) gives contiguous weights again. Returns how many banks
    are paired afterwards (banks whose w1 / w3 differ in dtype or device are left as they are)."""
    from k3export.model.moe import ExpertBank
    from k3export.plugins.moe.kernels import interleave_gate_up, paired_gate_up
    n = 0
    for bank in model.modules():
        if not isinstance(bank, ExpertBank) or bank.w1.dtype != bank.w3.dtype or bank.w1.device != bank.w3.device:
            continue
        if paired_gate_up(bank.w1, bank.w3) is None:
            _, w1, w3 = interleave_gate_up(bank.w1, bank.w3)
            bank.w1 = nn.Parameter(w1, requires_grad=bank.w1.requires_grad)
            bank.w3 = nn.Parameter(w3, requires_grad=bank.w3.requires_grad)
        n += 1
    return n


@torch.no_grad()
def unpair_experts(model: nn.Module) -> int:
    """Undo `pair_experts`: contiguous w1 and w3 again (same values). Returns how many banks were unpaired."""
    from k3export.model.moe import ExpertBank
    from k3export.plugins.moe.kernels import paired_gate_up
    n = 0
    for bank in model.modules():
        if isinstance(bank, ExpertBank) and paired_gate_up(bank.w1, bank.w3) is not None:
            bank.w1 = nn.Parameter(bank.w1.contiguous(), requires_grad=bank.w1.requires_grad)
            bank.w3 = nn.Parameter(bank.w3.contiguous(), requires_grad=bank.w3.requires_grad)
            n += 1
    return n


class GemvLinear(nn.Linear):
    """A bias-free `nn.Linear` whose calls of at most `gemv_rows` rows on CUDA (1 unless `gemv_linears(rows=)` set
    more) run `k3::gemv` (fp32 accumulation like cuBLAS, another summation order); other calls are `F.linear`. Only
    the class changes (`gemv_linears`): parameters, names and `state_dict` are the Linear's."""

    plain_linear = True          # computes F.linear(x, weight): code that folds a plain Linear may fold this one
    gemv_rows = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and 0 < x.numel() <= self.gemv_rows * x.shape[-1] and self.bias is None:
            from k3export.plugins.gemv.kernels import supported
            if supported(x, self.weight):
                return torch.ops.k3.gemv(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def _linears(model: nn.Module):
    """Every module of the model and of its packed swaps (which are not registered children)."""
    for mod in model.modules():
        yield mod
        for method in PROJECTION_SWAPS:
            swap = mod.__dict__.get(method)
            if isinstance(swap, (PackedLinear, PackedRuns, PackedGlu, NormCols)):
                yield from swap.modules()


def gemv_linears(model: nn.Module, on: bool = True, rows: int = 1) -> int:
    """Make every bias-free `nn.Linear` of the model (and of its packed GEMMs: pack first) a `GemvLinear` taking
    calls of up to `rows` rows (1: decode at B = 1; up to `kernels.MAX_BATCHED_ROWS` load their x in one batch), or
    (`on` False) every `GemvLinear` an `nn.Linear` again. Returns how many GemvLinears the model has afterwards."""
    import k3export.plugins.gemv.op  # noqa: F401  (registers k3::gemv)
    if rows < 1:
        raise ValueError(f"gemv_linears: rows must be >= 1, got {rows}")
    for m in _linears(model):
        if on and type(m) in (nn.Linear, GemvLinear) and m.bias is None:
            m.__class__ = GemvLinear
            if rows == 1:
                m.__dict__.pop("gemv_rows", None)
            else:
                m.gemv_rows = rows
        elif not on and type(m) is GemvLinear:
            m.__class__ = nn.Linear
            m.__dict__.pop("gemv_rows", None)
    return sum(type(m) is GemvLinear for m in _linears(model))


def unpack_projections(model: nn.Module) -> int:
    """Remove every serving swap (packed GEMMs, fused norms, GEMV linears): the owners' own methods and
    `nn.Linear` run again (the weights stay where they are). Returns how many method swaps were removed."""
    gemv_linears(model, on=False)
    return len(_remove_swaps(model))


def _remove_swaps(model: nn.Module, methods=SWAPPED) -> list[tuple[nn.Module, str, nn.Module]]:
    removed = []
    for mod in model.modules():
        for method in methods:
            if isinstance(mod.__dict__.get(method), PACKED):
                removed.append((mod, method, mod.__dict__.pop(method)))
    return removed


def packed_count(model: nn.Module) -> int:
    return sum(isinstance(m.__dict__.get(k), PACKED) for m in model.modules() for k in SWAPPED)


@contextlib.contextmanager
def unpacked(model: nn.Module):
    """Run a block on the model as written (e.g. `torch.export`, which would meet the packed weights as
    unregistered tensors); the swaps that were on are put back afterwards (the same modules: their weights are
    the members' storage, so in-place updates in the block reach them)."""
    removed = _remove_swaps(model)
    gemv = [m for m in _linears(model) if type(m) is GemvLinear]
    for m in gemv:
        m.__class__ = nn.Linear
    try:
        yield
    finally:
        for m in gemv:
            m.__class__ = GemvLinear
        for mod, method, swap in removed:
            mod.__dict__[method] = swap
