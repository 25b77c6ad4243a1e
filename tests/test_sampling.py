"""`k3export.sampling.draw`: the device-side draw of a token per row (temperature, top-k, top-p, Gumbel-max noise
keyed by seed and counter).

CPU: the torch form (`draw_reference`) against the distribution it must sample (frequencies over many counters,
chi-square), the filters, greedy rows, and a row's independence of its batch; the Triton program under
TRITON_INTERPRET=1 (a script run of this module, the `interp` fixture) with a small BLOCK against the torch form.
GPU (`cuda`): the program at k3-small's vocabulary, under a CUDA graph, against the torch form on the same device.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # the interpreter run (see `interp`): the flag must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

# chi-square's 0.999 quantiles (scipy.stats.chi2.ppf(0.999, df)): the draws are a fixed function of the counters, so
# a pass or a failure is the same on every run; a sampler off by a few percent in one bin exceeds these by far
CHI2_999 = {7: 24.32, 4: 18.47}


def _params(B, temperature, top_k=0, top_p=1.0, seed=7):
    return (torch.full((B,), float(temperature)), torch.full((B,), top_k, dtype=torch.int64),
            torch.full((B,), float(top_p)), torch.full((B,), seed, dtype=torch.int64))


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    n = tokens.numel()
    seen = torch.bincount(tokens, minlength=probs.numel()).double()
    want = probs.double() * n
    keep = want > 0
    assert seen[~keep].sum() == 0, "drew a token of probability 0"
    return float(((seen[keep] - want[keep]) ** 2 / want[keep]).sum())


def test_the_draw_samples_the_tempered_distribution():
    """20000 draws of one 8-token row (counters 0..19999): the frequencies of softmax(logits / T), at T 0.7 and
    1.5 (chi-square below its 0.999 quantile, 7 degrees of freedom)."""
    from k3export.sampling import draw_reference
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7]])
    N = 20000
    for T in (0.7, 1.5):
        toks = draw_reference(logits.expand(N, 8), *_params(N, T)[:3], _params(N, T)[3], torch.arange(N))
        assert _chi2(toks, torch.softmax(logits[0] / T, -1)) < CHI2_999[7], T


def test_top_k_and_top_p_keep_what_they_should():
    """top-k 5 of 8: only the 5 largest, in their renormalised proportions; top-p 0.8 on top of it: the smallest
    prefix of those whose mass before its last token is at most 0.8 (here the first 3 of them)."""
    from k3export.sampling import draw_reference, keep_threshold
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7]])
    N = 20000
    t, k, p, s = _params(N, 1.0, top_k=5)
    toks = draw_reference(logits.expand(N, 8), t, k, p, s, torch.arange(N))
    top5 = torch.zeros(8)
    top5[[3, 5, 0, 7, 1]] = torch.softmax(logits[0, [3, 5, 0, 7, 1]], -1)
    assert _chi2(toks, top5) < CHI2_999[4]
    probs = torch.softmax(logits[0, [3, 5, 0, 7, 1]], -1)          # 0.41, 0.25, 0.15, 0.11, 0.07
    assert probs[:2].sum() < 0.8 < probs[:3].sum()                  # so top-p 0.8 keeps 3
    thr = keep_threshold(logits, torch.tensor([5]), torch.tensor([0.8]))
    assert thr.item() == logits[0, 0].item()
    t, k, p, s = _params(N, 1.0, top_k=5, top_p=0.8)
    toks = draw_reference(logits.expand(N, 8), t, k, p, s, torch.arange(N))
    assert set(toks.tolist()) == {3, 5, 0}
    assert keep_threshold(logits, torch.tensor([0]), torch.tensor([1.0])).item() == float("-inf")
    assert keep_threshold(logits, torch.tensor([1]), torch.tensor([1.0])).item() == 2.0


def test_greedy_rows_and_a_rows_independence_of_its_batch():
    """Temperature 0 is the argmax (NaN counted as the largest); a row's token depends on its own logits, seed and
    counter only: the same alone as in a batch of others with other settings, and other seeds or counters draw
    differently."""
    from k3export.sampling import draw, uniforms
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g) * 2
    logits[5, 17] = float("nan")
    temp = torch.tensor([0.0, 0.8, 1.0, 1.2, 0.9, 0.0])
    top_k = torch.tensor([0, 0, 40, 0, 10, 0])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.7, 0.95, 1.0])
    seed = torch.tensor([1, 2, 3, 4, 2 ** 40 + 5, 6])
    counter = torch.tensor([10, 11, 12, 13, 14, 15])
    toks = draw(logits, temp, top_k, top_p, seed, counter)
    assert toks[0] == logits[0].argmax() and toks[5] == 17
    for b in range(6):
        one = draw(logits[b:b + 1], temp[b:b + 1], top_k[b:b + 1], top_p[b:b + 1], seed[b:b + 1], counter[b:b + 1])
        assert one.item() == toks[b].item(), b
    u = uniforms(seed, counter, 500)
    assert torch.equal(u[3], uniforms(seed[3:4], counter[3:4], 500)[0])
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[1], uniforms(seed[1:2], counter[1:2] + 1, 500)[0])
    assert not torch.equal(u[1], uniforms(seed[1:2] + 1, counter[1:2], 500)[0])
    drawn = {draw(logits[1:2], temp[1:2], top_k[1:2], top_p[1:2], seed[1:2], torch.tensor([c])).item()
             for c in range(40)}
    assert len(drawn) > 3                                           # it does sample
    with pytest.raises(ValueError, match=r"top_p needs one value per row \(6\)"):
        draw(logits, temp, top_k, top_p[:2], seed, counter)
    with pytest.raises(ValueError, match=r"logits \[B, V\]"):
        draw(logits[0], temp, top_k, top_p, seed, counter)


def test_the_draw_width():
    """The sorted width a batch's draw needs: the largest top_k when every filtered row sets one, None (a full sort)
    when a row filters by top-p alone; greedy rows and rows without a filter ask for nothing."""
    from k3export.generate import Sampling, width
    from k3export.sampling import draw, sort_width
    assert sort_width([50, 0], [1.0, 1.0], 100) == 50
    assert sort_width([50, 0], [1.0, 0.9], 100) is None
    assert sort_width([500, 7], [0.9, 1.0], 100) == 100
    assert width([Sampling(temperature=0.0, top_p=0.5), Sampling(temperature=1.0, top_k=8)], 100) == 8
    assert width([Sampling(temperature=1.0, top_p=0.5)], 100) is None
    with pytest.raises(ValueError, match="width must be a positive count"):
        draw(torch.zeros(1, 4), *_params(1, 1.0)[:3], torch.zeros(1, dtype=torch.int64), torch.zeros(1), width=0)


def _interpreter_cases() -> dict:
    from k3export import sampling as sm
    g = torch.Generator().manual_seed(1)
    words = torch.randn(4, 600, generator=g) * 3
    cases = {"contiguous": torch.randn(4, 300, generator=g) * 3, "stride2": words[:, 0::2],
             "bf16": (torch.randn(4, 300, generator=g) * 3).bfloat16()}
    nan = torch.randn(4, 300, generator=g)
    nan[0, 123] = float("nan")
    cases["nan"] = nan
    temp = torch.tensor([0.0, 0.8, 1.0, 1.3])
    top_k = torch.tensor([0, 0, 30, 5])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.8])
    seed = torch.tensor([1, 2, 3, 2 ** 40 + 5])
    res = {}
    for name, x in cases.items():
        for filtered in (True, False):
            got, want = [], []
            for c in range(8):                       # 8 counters: 32 draws a case
                counter = torch.full((4,), 100 + c)
                got += sm.launch(x, temp, top_k, top_p, seed, counter, filtered=filtered, block=64,
                                 parts=1 + c % 3).tolist()          # (rows in 1, 2 or 3 programs)
                want += sm.draw_reference(x, temp, top_k, top_p, seed, counter, filtered).tolist()
            res[f"{name}-{'filtered' if filtered else 'plain'}"] = {"got": got, "want": want}
    z = torch.randn(6, 300, generator=g) * 3
    z[4] = (z[4] * 2).round()                        # ties: at most ~40 distinct values
    thr_args = (torch.tensor([0.0, 0.8, 1.0, 1.3, 1.0, 0.7]), torch.tensor([0, 0, 30, 5, 0, 400]),
                torch.tensor([1.0, 0.9, 1.0, 0.8, 0.5, 0.95]))
    zt = z / torch.where(thr_args[0] > 0, thr_args[0], torch.ones(6))[:, None]
    want = sm.keep_threshold(zt, thr_args[1], thr_args[2]).tolist()
    res["thresholds"] = {"got": sm.program_thresholds(z, *thr_args, block=64).tolist(), "want": want}
    k_args = (thr_args[0][2:4], thr_args[1][2:4], thr_args[2][2:4])
    res["thresholds-width"] = {"got": sm.program_thresholds(z[2:4], *k_args, width=30, block=64).tolist(),
                               "want": want[2:4]}
    res["width-30"] = {"got": [], "want": []}
    for c in range(8):
        counter = torch.full((2,), 100 + c)
        res["width-30"]["got"] += sm.launch(z[2:4], *k_args, seed[:2], counter, width=30, block=64).tolist()
        res["width-30"]["want"] += sm.draw_reference(z[2:4], *k_args, seed[:2], counter).tolist()
    ring, lengths = torch.full((4, 6), -1, dtype=torch.int64), torch.tensor([9, 4, 6, 3])
    toks = sm.launch(cases["stride2"], temp, top_k, top_p, seed, lengths, block=64, post=(ring[:, :4], lengths),
                     parts=2)
    want = torch.full((4, 6), -1, dtype=torch.int64)
    sm.post_reference((want[:, :4], lengths), toks)
    res["post"] = {"got": ring.tolist(), "want": want.tolist()}
    ring = torch.full((4, 6), 77, dtype=torch.int64)            # a fail word set: UNPOSTED (-1) where the tokens go
    fail = torch.tensor([3], dtype=torch.int32)
    sm.launch(cases["stride2"], temp, top_k, top_p, seed, lengths, block=64, post=(ring[:, :4], lengths, fail))
    want = torch.full((4, 6), 77, dtype=torch.int64)
    sm.post_reference((want[:, :4], lengths, fail), toks)
    res["post-fail"] = {"got": ring.tolist(), "want": want.tolist()}
    into = torch.full((4,), -1, dtype=torch.int64)
    counter = torch.full((4,), 3)
    sm.launch(cases["stride2"], temp, top_k, top_p, seed, counter, out=into, block=64)
    res["into"] = {"got": into.tolist(),
                   "want": sm.draw_reference(cases["stride2"], temp, top_k, top_p, seed, counter).tolist()}
    return res


def test_the_draw_program_equals_the_torch_form(interp):
    assert len(interp) == 14 and -1 in sum(interp["post-fail"]["got"], [])
    for name, r in interp.items():
        assert r["got"] == r["want"], (name, r)


@pytest.mark.cuda
def test_the_draw_program_on_the_gpu():
    """k3-small's 32768 logits (as the megakernel's stride-2 view and contiguous), 64 rows of mixed settings, 16
    counters each: the Triton program's tokens are the torch form's on the same device, also replayed in a CUDA
    graph (counters moved between replays)."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU; run `make test-gpu` on the GPU machine")
    from k3export.sampling import draw, draw_reference
    g = torch.Generator(device="cuda").manual_seed(0)
    B, V = 64, 32768
    words = torch.randn(B, 2 * V, generator=g, device="cuda") * 4
    rows = torch.arange(B, device="cuda")
    temp = torch.where(rows % 4 == 0, 0.0, 0.5 + (rows % 7) / 7).float()
    top_k = torch.where(rows % 3 == 0, 50, 0)
    top_p = torch.where(rows % 5 == 0, 0.9, 1.0).float()
    seed = rows * 1000 + 17
    differ = 0
    for x in (words[:, 0::2], words[:, :V].contiguous()):
        for c in range(16):
            counter = torch.full((B,), 1000 + c, device="cuda")
            differ += int((draw(x, temp, top_k, top_p, seed, counter) !=
                           draw_reference(x, temp, top_k, top_p, seed, counter)).sum())
    assert differ == 0
    x = words[:, 0::2]
    counter = torch.full((B,), 5, device="cuda")
    out = torch.empty(B, dtype=torch.int64, device="cuda")
    draw(x, temp, top_k, top_p, seed, counter, out=out)             # (warm-up: the program's compile)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        draw(x, temp, top_k, top_p, seed, counter, out=out)
    for c in (5, 6, 7):
        counter.fill_(c)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, draw_reference(x, temp, top_k, top_p, seed, counter)), c


def _thresholds_agree(z, top_k, top_p, got) -> int:
    """How many rows' program threshold differs from `keep_threshold`'s; each such row must sit at a near tie of
    its top-p edge: the mass before the kept tokens' last one (in fp64) within 1e-5 of top_p, where fp32 sums of
    32768 terms in two orders can land on either side (a few 1e-7 relative apart)."""
    from k3export.sampling import keep_threshold
    want = keep_threshold(z, top_k, top_p)
    bad = (got != want).nonzero().flatten().tolist()
    for b in bad:
        sz = z[b].double().sort(descending=True).values
        k = int(top_k[b]) or sz.numel()
        p = torch.softmax(sz[:k], 0)
        before = p.cumsum(0) - p
        edge = [(sz[:k] == v).nonzero()[0].item() for v in (float(got[b]), float(want[b]))]
        assert all(abs(before[i].item() - float(top_p[b])) < 1e-5 for i in edge), (b, edge, float(top_p[b]))
    return len(bad)


@pytest.mark.cuda
def test_the_program_thresholds_and_widths_on_the_gpu():
    """The program's keep thresholds (`program_thresholds`: torch's sort, then `_threshold`'s scan) against
    `keep_threshold` over 64 rows of k3-small's 32768 logits, peaked (x 4) and flat (x 0.25: top-p 0.9 keeps
    thousands); a top-k instead of the sort (`width`) draws the same tokens; K3's 163840-word vocabulary draws as the
    torch form does."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU; run `make test-gpu` on the GPU machine")
    from k3export.sampling import draw, draw_reference, program_thresholds
    g = torch.Generator(device="cuda").manual_seed(1)
    B, V = 64, 32768
    rows = torch.arange(B, device="cuda")
    temp = torch.where(rows % 4 == 0, 0.0, 0.5 + (rows % 7) / 7).float()
    top_k = torch.where(rows % 3 == 0, 50, torch.where(rows % 3 == 1, 2000, 0))
    top_p = torch.where(rows % 2 == 0, 0.9, torch.where(rows % 3 == 2, 1.0, 0.6)).float()
    differ = 0
    for scale in (4.0, 0.25):
        x = (torch.randn(B, 2 * V, generator=g, device="cuda") * scale)[:, 0::2]
        z = x.float() / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
        differ += _thresholds_agree(z, top_k, top_p, program_thresholds(x, temp, top_k, top_p))
    print(f"thresholds: {differ} of {2 * B} rows at a near tie")
    some = rows[top_k > 0]
    x = (torch.randn(B, V, generator=g, device="cuda") * 2)[some]
    args = (temp[some], top_k[some], top_p[some], some * 31 + 1)
    for c in range(8):
        counter = torch.full_like(some, 50 + c)
        assert torch.equal(draw(x, *args, counter, width=2000), draw_reference(x, *args, counter)), c
    x = torch.randn(4, 163840, generator=g, device="cuda").bfloat16() * 4
    args = (torch.tensor([0.0, 0.7, 1.0, 1.2], device="cuda"), torch.tensor([0, 0, 40, 0], device="cuda"),
            torch.tensor([1.0, 0.95, 1.0, 0.8], device="cuda"), torch.arange(4, device="cuda"))
    for c in range(8):
        counter = torch.full((4,), 9 + c, device="cuda")
        for f in (True, False):
            assert torch.equal(draw(x, *args, counter, filtered=f), draw_reference(x, *args, counter, f)), (c, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(json.dumps(_interpreter_cases()))
