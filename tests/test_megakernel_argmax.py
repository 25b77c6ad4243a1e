"""`k3export.megakernel.argmax.argmax_rows` (greedy decoding's argmax over the megakernel's stride-2 logits) against
`torch.argmax`: the same index in every case, ties and all.

CPU: the Triton program runs under TRITON_INTERPRET=1 (a script run of this module, the `interp` fixture), with a
small BLOCK so that rows take several rounds and end in a partial one: random rows (fp32 and bf16, contiguous and
stride 2, as the backend's view of its output words), rows whose largest value repeats (in one lane and across
lanes and rounds), all -inf, a row of one value, NaN (counted as +inf). GPU (`cuda`): k3-small's 32768 logits as the
backend's view, and K3's 163840.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # the interpreter run (see `interp`): the flag must be set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch


def _rows(seed: int) -> dict[str, torch.Tensor]:
    """Named cases [B, V] (V = 300: with BLOCK 64, four full rounds and a partial one)."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randn(3, 600, generator=g)
    cases = {"fp32": torch.randn(3, 300, generator=g), "stride2": words[:, 0::2],
             "bf16": torch.randn(3, 300, generator=g).bfloat16()}
    tie = torch.randn(4, 300, generator=g)
    tie[0, [7, 71, 135, 299]] = 10.0           # one lane (7 + 64 k), then the partial round's last
    tie[1, [5, 70, 200]] = 10.0                # three lanes, three rounds
    tie[2, [250, 12]] = 10.0                   # the later round's lane first in lane order
    tie[3] = 1.0                               # every value the largest: index 0
    cases["ties"] = tie
    cases["neg_inf"] = torch.full((2, 300), float("-inf"))
    nan = torch.randn(2, 300, generator=g)
    nan[0, 123] = float("nan")
    nan[1, [40, 41]] = float("inf")
    cases["nan"] = nan
    cases["one"] = torch.randn(2, 1, generator=g)
    return cases


def _interpreter_cases() -> dict:
    from k3export.megakernel import argmax as am
    res = {}
    for name, x in _rows(0).items():
        out = am.launch(x, block=64)
        res[name] = {"got": out.tolist(), "want": x.float().argmax(-1).tolist()}
    into = torch.full((3,), -1, dtype=torch.int64)
    x = _rows(1)["stride2"]
    am.launch(x, out=into, block=64)
    res["into"] = {"got": into.tolist(), "want": x.argmax(-1).tolist()}
    return res


def test_the_argmax_program_equals_torch_argmax(interp):
    assert set(interp) == {"fp32", "stride2", "bf16", "ties", "neg_inf", "nan", "one", "into"}
    for name, r in interp.items():
        assert r["got"] == r["want"], (name, r)


def test_the_argmax_off_the_gpu_is_torch_argmax():
    from k3export.megakernel.argmax import argmax_rows
    x = torch.randn(2, 50)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    out = torch.empty(2, dtype=torch.int64)
    assert argmax_rows(x[:, ::2], out=out) is out and torch.equal(out, x[:, ::2].argmax(-1))
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        argmax_rows(x[0])


def test_the_backend_falls_back_to_torch_argmax_once_the_program_fails(tiny_mla8, monkeypatch):
    """`MegakernelBackend.argmax_into`: a Triton argmax that raises (a build problem on some machine) warns once and
    leaves torch.argmax's index; later calls go straight to torch."""
    from k3export.megakernel import backend as mb
    from k3export.runtime import EagerBackend
    cfg, model = tiny_mla8
    be = mb.MegakernelBackend(model, max_len=24, prefill_backend=EagerBackend(model), emulate=True)
    calls = []

    def broken(x, out=None):
        calls.append(1)
        raise RuntimeError("no sm_90 build\nmore")
    monkeypatch.setattr(mb, "argmax_rows", broken)
    x, out = torch.randn(1, 40)[:, ::2], torch.full((1,), -1, dtype=torch.int64)
    with pytest.warns(RuntimeWarning, match="torch.argmax instead"):
        be.argmax_into(x, out)
    assert out.tolist() == x.argmax(-1).tolist() and be.argmax_error == "RuntimeError: no sm_90 build"
    be.argmax_into(x * -1, out)
    assert out.tolist() == (x * -1).argmax(-1).tolist() and len(calls) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [32768, 163840])
def test_the_argmax_program_on_the_gpu(vocab):
    """k3-small's and K3's vocabularies as the backend's stride-2 view of its 8-byte words: torch.argmax's index."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU; run `make test-gpu` on the GPU machine")
    from k3export.megakernel.argmax import argmax_rows
    g = torch.Generator(device="cuda").manual_seed(vocab)
    for _ in range(5):
        words = torch.randn(1, 2 * vocab, generator=g, device="cuda")
        x = words[:, 0::2]
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    x[0, [vocab // 3, vocab - 1]] = x.max() + 1
    assert argmax_rows(x).item() == vocab // 3


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(json.dumps(_interpreter_cases()))
