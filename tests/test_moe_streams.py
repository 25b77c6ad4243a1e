"""`k3::moe_decode_streams` (plugins/moe/streams.py) and its swap (`packing.StreamedMoE`): the MoE sublayer at one
decode row with the shared experts on a second CUDA stream. CPU: the op's reference is the sublayer as the glu /
fold_norm packs compute it, and the swap is installed and removed with the others. GPU: the two-stream launches
give the one-stream launches' bits, eagerly and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from k3export.config import K3Config
from k3export.model import packing
from k3export.model.moe import LatentMoE
from k3export.model.weights import random_model


def _moe_model(device="cpu", dtype=torch.float32, preset="k3-tiny"):
    model = random_model(K3Config.from_name(preset), seed=0, dtype=dtype, device=device)
    return model, [m for m in model.modules() if isinstance(m, LatentMoE)]


def _op_args(moe: LatentMoE, x: torch.Tensor):
    sw = moe.__dict__["mix"]
    r = sw.routing
    return (x, sw.glu.linear.weight, sw.glu.n_plain, moe.gate.weight, moe.gate.e_score_correction_bias,
            moe.experts.w1, moe.experts.w3, moe.experts.w2, sw.cols.packed.linear.weight, sw.cols.norm.weight,
            sw.cols.norm.eps, r["top_k"], r["renormalize"], r["scaling"], r["beta"], r["linear_beta"])


def test_streams_swap_installed_with_glu_and_fold_norm_and_removed():
    model, moes = _moe_model()
    assert moes and all("mix" not in m.__dict__ for m in moes)
    packing.pack_projections(model, glu=True, fold_norm=True, streams=True)
    assert all(isinstance(m.__dict__.get("mix"), packing.StreamedMoE) for m in moes)
    packing.pack_projections(model, glu=True, fold_norm=False, streams=True)    # needs both packs: not installed
    assert all("mix" not in m.__dict__ for m in moes)
    packing.pack_projections(model, glu=True, fold_norm=True, streams=True)
    packing.unpack_projections(model)
    assert all("mix" not in m.__dict__ for m in moes)


def test_streams_op_reference_is_the_packed_sublayer():
    """The op's reference (what CPU runs) on the packed weights == the MoE sublayer as written (fp32: to rounding
    of the activation taken from fp32 sums vs from rounded gate / up, ~1e-6), and the swapped module's CPU path ==
    the op's reference."""
    import k3export.plugins.moe.streams  # noqa: F401
    model, moes = _moe_model()
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, model.config.hidden_size, generator=g) for _ in moes]
    with torch.no_grad():
        want = [m(x) for m, x in zip(moes, xs)]
        packing.pack_projections(model, glu=True, fold_norm=True, streams=True)
        for m, x, w in zip(moes, xs, want):
            y = torch.ops.k3.moe_decode_streams(*_op_args(m, x))
            assert y.shape == w.shape and y.dtype == w.dtype
            assert ((y - w).norm() / w.norm()).item() < 1e-5
            assert torch.allclose(m(x), y, rtol=1e-5, atol=1e-6)


def test_streams_op_fake_shape_for_compile():
    """The op traces (its fake gives `[N, d]`): torch.compile of the swapped k3-tiny MoE on CPU equals eager."""
    import k3export.plugins.moe.streams  # noqa: F401
    model, moes = _moe_model()
    packing.pack_projections(model, glu=True, fold_norm=True, streams=True)
    x = torch.randn(1, model.config.hidden_size)
    with torch.no_grad():
        args = _op_args(moes[0], x)
        fn = torch.compile(lambda *a: torch.ops.k3.moe_decode_streams(*a), fullgraph=True)
        assert torch.allclose(fn(*args), torch.ops.k3.moe_decode_streams(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("preset,dtype", [("k3-small", torch.bfloat16), ("k3-tiny", torch.float32)])
def test_streams_fork_equals_one_stream_cuda(preset, dtype, monkeypatch):
    """The swapped MoE at one row on CUDA (GEMV linears, PDL as the compile backend runs it): two streams
    (K3_MOE_STREAMS=1) give the one-stream launches' bits, eagerly and replayed 3 times from a CUDA graph, and
    both stay near the sublayer as written: bf16 within 4 ulps relative (4 x 2^-8: the packs round z, h, u and
    the normalised u once each, at other points than the unpacked sublayer), fp32 within 1e-5."""
    from k3export.plugins import launch as L
    model, moes = _moe_model("cuda", dtype, preset)
    moe = moes[0]
    x = torch.randn(1, model.config.hidden_size, device="cuda", dtype=dtype)
    with torch.no_grad():
        want = moe(x).float()
        packing.pack_projections(model, glu=True, fold_norm=True, streams=True)
        packing.gemv_linears(model)
        pdl = torch.cuda.get_device_capability()[0] >= 9
        outs = {}
        for streams in ("0", "1"):
            monkeypatch.setenv("K3_MOE_STREAMS", streams)
            with L.pdl(pdl, early=pdl):
                eager = moe(x)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    moe(x)                                          # warm-up outside the capture
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = moe(x)
            replays = []
            for _ in range(3):
                graph.replay()
                torch.cuda.synchronize()
                replays.append(out.clone())
            outs[streams] = (eager, replays)
        packing.unpack_projections(model)
    (e0, r0), (e1, r1) = outs["0"], outs["1"]
    assert torch.equal(e0, e1) and all(torch.equal(e0, r) for r in r0 + r1)
    err = ((e1.float() - want).norm() / want.norm()).item()
    print(f"moe_decode_streams {preset}: two streams == one stream (eager, 3 graph replays); vs the sublayer as "
          f"written {err:.2e}")
    assert err < (4 * 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5)
