"""`k3export.sampling.argmax_rows` (greedy decoding's argmax, e.g. over the megakernel's stride-2 logits) against
`torch.argmax`: the same index in every case, ties and all; its post of the tokens into a ring.

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

def test_a_backend_that_commits_the_lengths_in_its_step_replaces_the_engines_add(tiny_mla8):
    """A backend with `commits_lengths` (the megakernel's COMMIT_LENGTHS launch) gets the engine's active flags in
    every `decode_` and adds them to the lengths itself, writing its new MLA rows into the cache (rows None): the
    engine adds nothing, so each slot's length moves once a step, and greedy and sampled generation over requests
    of different lengths, joining and leaving (with `takes_argmax` too, as the megakernel has both), give the
    engine's own tokens. A backend that commits the lengths but hands rows back is refused."""
    from k3export import runtime as rt
    from k3export.generate import Sampling
    from k3export.sampling import post_reference
    cfg, model = tiny_mla8
    calls = []

    class Committing(rt.EagerBackend):
        commits_lengths = True
        rows_back = False

        def decode_(self, ids, conv, rec, cache, lengths, argmax=None, active=None):
            calls.append(active is not None)
            logits, rows = model.forward_decode_(ids, conv, rec, cache, lengths)
            if self.rows_back:
                return logits, rows
            n_mla, B, _, R = cache.shape            # (what the launch does: its rows in, then the lengths moved)
            pos = lengths.clamp(max=cache.shape[2] - 1).view(1, B, 1, 1).expand(n_mla, B, 1, R)
            cache.scatter_(2, pos, rows.to(cache.dtype))
            if argmax is not None:
                out, ring, _ = argmax
                out.copy_(logits.argmax(-1))
                if ring is not None:
                    post_reference((ring, lengths + active), out)
            lengths.add_(active)
            return logits, None

    class CommittingArgmax(Committing):
        takes_argmax = True

    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    sampled = Sampling(temperature=0.8, top_p=0.9, seed=3)
    ref = rt.Engine(rt.EagerBackend(model), 2, 24, cuda_graphs=False)
    want = rt.Generator(ref).generate(prompts, 6)
    want_sampled = rt.Generator(ref).generate(prompts, 6, sampled)
    for cls in (Committing, CommittingArgmax):
        for pipeline in (True, False):
            eng = rt.Engine(cls(model), 2, 24, cuda_graphs=False)
            assert rt.Generator(eng, pipeline=pipeline).generate(prompts, 6) == want, (cls, pipeline)
            assert rt.Generator(eng, pipeline=pipeline).generate(prompts, 6, sampled) == want_sampled, (cls, pipeline)
    assert calls and all(calls)
    eng = rt.Engine(Committing(model), 2, 24, cuda_graphs=False)
    eng.prefill([0], [[1, 2, 3]])
    eng.decode(torch.tensor([5, 0]))
    eng.decode(torch.tensor([6, 0]))
    assert eng.state.lengths.tolist() == [5, 0]        # (3 prompt rows, 2 steps; the idle slot not moved)
    bad = Committing(model)
    bad.rows_back = True
    eng = rt.Engine(bad, 2, 24, cuda_graphs=False)
    eng.prefill([0], [[1, 2, 3]])
    with pytest.raises(RuntimeError, match="commits the lengths in its step"):
        eng.decode(torch.tensor([5, 0]))


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
    from k3export import sampling as sm
    res = {}
    for name, x in _rows(0).items():
        out = sm.launch_argmax(x, block=64)
        res[name] = {"got": out.tolist(), "want": x.float().argmax(-1).tolist()}
        for parts in (2, 3):                  # rows split over programs (192 + 108; 128 x 2 + 44): the combine
            out = sm.launch_argmax(x, block=64, parts=parts)
            res[f"{name}-parts{parts}"] = {"got": out.tolist(), "want": x.float().argmax(-1).tolist()}
    into = torch.full((3,), -1, dtype=torch.int64)
    x = _rows(1)["stride2"]
    sm.launch_argmax(x, out=into, block=64)
    res["into"] = {"got": into.tolist(), "want": x.argmax(-1).tolist()}
    ring, lengths = torch.full((4, 5), -1, dtype=torch.int64), torch.tensor([7, 2, 5])
    sm.launch_argmax(x, block=64, post=(ring[:, :3], lengths), parts=3)
    want = torch.full((4, 5), -1, dtype=torch.int64)
    sm.post_reference((want[:, :3], lengths), x.argmax(-1))
    res["post"] = {"got": ring.tolist(), "want": want.tolist()}
    for f in (0, 1):                          # a fail word: set, the program posts UNPOSTED (-1) instead
        ring, fail = torch.full((4, 5), 77, dtype=torch.int64), torch.tensor([f, 5], dtype=torch.int32)
        out = sm.launch_argmax(x, block=64, post=(ring[:, :3], lengths, fail), parts=2)
        want = torch.full((4, 5), 77, dtype=torch.int64)
        sm.post_reference((want[:, :3], lengths, fail), x.argmax(-1))
        res[f"post-fail{f}"] = {"got": [ring.tolist(), out.tolist()], "want": [want.tolist(), x.argmax(-1).tolist()]}
    return res


def test_post_puts_each_rows_token_at_its_length_in_the_ring():
    """`post_reference` (the programs' POST as torch ops): row b's token at ring[lengths[b] % rows, b], nothing else
    written; a ring that is not [rows, slots] int64 with unit column stride is refused."""
    from k3export.sampling import argmax_rows, post_args, post_reference
    ring = torch.full((4, 5), -1, dtype=torch.int64)
    post_reference((ring[:, :3], torch.tensor([7, 2, 5])), torch.tensor([11, 12, 13]))
    assert ring[3, 0] == 11 and ring[2, 1] == 12 and ring[1, 2] == 13 and int((ring != -1).sum()) == 3
    x = torch.randn(3, 50)
    argmax_rows(x, post=(ring[:, :3], torch.tensor([8, 8, 8])))             # (the CPU's torch path posts too)
    assert ring[0, :3].tolist() == x.argmax(-1).tolist()
    with pytest.raises(ValueError, match="unit column stride"):
        post_args((ring.t(), torch.zeros(5, dtype=torch.int64)), ring)
    # a fail word (the megakernel's give-up word): set, UNPOSTED where the tokens would go; clear, the tokens
    for f, want in ((1, [-1, -1, -1]), (0, [21, 22, 23])):
        ring = torch.full((4, 5), 9, dtype=torch.int64)
        post_reference((ring[:, :3], torch.tensor([6, 6, 6]), torch.tensor([f], dtype=torch.int32)),
                       torch.tensor([21, 22, 23]))
        assert ring[2, :3].tolist() == want and int((ring != 9).sum()) == 3
    with pytest.raises(ValueError, match="fail is an int32 word"):
        post_args((ring, torch.zeros(5, dtype=torch.int64), torch.zeros(1)), ring)


def test_the_argmax_program_equals_torch_argmax(interp):
    cases = {"fp32", "stride2", "bf16", "ties", "neg_inf", "nan", "one"}
    assert set(interp) == cases | {f"{c}-parts{p}" for c in cases for p in (2, 3)} | {"into", "post", "post-fail0",
                                                                                         "post-fail1"}
    assert -1 in interp["post-fail1"]["got"][0][0] + interp["post-fail1"]["got"][0][3]    # (rows 7 % 4, 5 % 4...)
    for name, r in interp.items():
        assert r["got"] == r["want"], (name, r)


def test_the_argmax_off_the_gpu_is_torch_argmax():
    from k3export.sampling import argmax_rows
    x = torch.randn(2, 50)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    out = torch.empty(2, dtype=torch.int64)
    assert argmax_rows(x[:, ::2], out=out) is out and torch.equal(out, x[:, ::2].argmax(-1))
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        argmax_rows(x[0])


def test_the_engine_posts_its_tokens_and_falls_back_to_torch_argmax_once_the_program_fails(tiny_mla8, monkeypatch):
    """`Engine.decode_greedy` leaves each active slot's token in the host ring (`post_mark`, `posted`: the returned
    buffer's), also for `decode_sampled`; a Triton argmax that raises (a build problem on some machine) warns once
    and leaves torch.argmax's index, without the ring (post_mark None); later steps go straight to torch."""
    from k3export import runtime as rt
    from k3export.generate import Sampling
    cfg, model = tiny_mla8
    eng = rt.Engine(rt.EagerBackend(model), max_batch=3, max_len=24, cuda_graphs=False)
    eng.prefill([0, 2], [[1, 2, 3], [4, 5]])
    for _ in range(5):                                      # (past the ring's 4 rows)
        ids = eng.decode_greedy().tolist()
        mark = eng.post_mark()
        assert mark == [4 + _, 0, 3 + _] and [eng.posted(mark)[b] for b in (0, 2)] == [ids[0], ids[2]]
    eng.set_sampling([0, 2], [Sampling(temperature=0.9, top_p=0.8, seed=3)] * 2)
    ids = eng.decode_sampled().tolist()
    assert [eng.posted(eng.post_mark())[b] for b in (0, 2)] == [ids[0], ids[2]]
    calls = []

    def broken(x, out=None, post=None, early=False):
        calls.append(1)
        raise RuntimeError("no sm_90 build\nmore")
    monkeypatch.setattr(rt, "argmax_rows", broken)
    with pytest.warns(RuntimeWarning, match="torch.argmax instead"):
        ids = eng.decode_greedy().tolist()
    want = eng.last_logits.argmax(-1).tolist()
    assert [ids[0], ids[2]] == [want[0], want[2]] and eng.argmax_error == "RuntimeError: no sm_90 build"
    assert eng.post_mark() is None
    ids = eng.decode_greedy().tolist()
    want = eng.last_logits.argmax(-1).tolist()
    assert [ids[0], ids[2]] == [want[0], want[2]] and len(calls) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [32768, 163840])
def test_the_argmax_program_on_the_gpu(vocab):
    """k3-small's and K3's vocabularies as the backend's stride-2 view of its 8-byte words: torch.argmax's index."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU; run `make test-gpu` on the GPU machine")
    from k3export.sampling import argmax_rows
    g = torch.Generator(device="cuda").manual_seed(vocab)
    for _ in range(5):
        words = torch.randn(1, 2 * vocab, generator=g, device="cuda")
        x = words[:, 0::2]
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    x[0, [vocab // 3, vocab - 1]] = x.max() + 1
    assert argmax_rows(x).item() == vocab // 3
    # rows split over programs (B = 1 and 8: one part a 2048 values, up to 264 programs; B = 300: one a row), the last
    # part combining; replayed from a CUDA graph 40 times over new values with the ring posted: each replay's
    # index (the count of finished parts is back to 0 after each)
    from k3export.sampling import row_parts
    for B in (1, 8, 300):
        print(B, row_parts(B, vocab, 2048))
        words = torch.randn(B, 2 * vocab, generator=g, device="cuda")
        x = words[:, 0::2]
        assert torch.equal(argmax_rows(x), x.argmax(-1)), B
    B = 3
    words = torch.randn(B, 2 * vocab, generator=g, device="cuda")
    x, out = words[:, 0::2], torch.empty(B, dtype=torch.int64, device="cuda")
    ring = torch.full((4, B), -1, dtype=torch.int64, pin_memory=True)
    lengths = torch.tensor([5, 9, 2], device="cuda")
    argmax_rows(x, out=out, post=(ring, lengths))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_rows(x, out=out, post=(ring, lengths))
        lengths.add_(1)
    for r in range(40):
        words.normal_(generator=g)
        want = x.argmax(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), r
        at = ((lengths - 1) % 4).tolist()
        assert [int(ring[at[b], b]) for b in range(B)] == want.tolist(), r


def test_a_backend_that_takes_the_argmax_in_its_step_replaces_the_engines_program(tiny_mla8, monkeypatch):
    """A backend with `takes_argmax` (the megakernel's launch) gets the engine's ids buffer, host ring and active
    flags in its greedy `decode_` and writes the tokens there itself: the engine runs no argmax program of its own
    (its Triton argmax here raises if called), the plain step passes nothing, and the Generator's greedy tokens,
    pipelined and not, and the ring's posts are those of the engine's own argmax."""
    from k3export import runtime as rt
    from k3export.sampling import post_reference
    cfg, model = tiny_mla8
    seen = []

    class Taking(rt.EagerBackend):
        takes_argmax = True

        def decode_(self, ids, conv, rec, cache, lengths, argmax=None):
            seen.append(argmax is not None)
            logits, rows = model.forward_decode_(ids, conv, rec, cache, lengths)
            if argmax is not None:                      # (what the launch does: after the step, before the count)
                out, ring, active = argmax
                out.copy_(logits.argmax(-1))
                if ring is not None:
                    post_reference((ring, lengths + active), out)
            return logits, rows

    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    want = rt.Generator(rt.Engine(rt.EagerBackend(model), 2, 24, cuda_graphs=False)).generate(prompts, 6)

    def refused(*a, **k):
        raise AssertionError("the engine ran its own argmax")
    monkeypatch.setattr(rt, "argmax_rows", refused)
    for pipeline in (True, False):
        eng = rt.Engine(Taking(model), 2, 24, cuda_graphs=False)
        assert rt.Generator(eng, pipeline=pipeline).generate(prompts, 6) == want
    assert seen.count(True) >= 3                    # (the pipelined loop's greedy steps; the plain one decodes)
    eng.prefill([1], [[9, 8]])
    ids = eng.decode_greedy().tolist()
    assert eng.posted(eng.post_mark())[1] == ids[1] == int(eng.last_logits[1].argmax())
    seen.clear()
    eng.decode(torch.tensor([3, 4]))
    assert seen == [False]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(json.dumps(_interpreter_cases()))


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "plain"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_backend_whose_step_failed_gets_no_token_posted_and_the_generator_stops(tiny_mla8, sampled, pipeline):
    """A backend with a `post_fail` word (the megakernel's give-up word) that its failed step sets: the engine's
    argmax / draw program posts UNPOSTED instead of tokens from that step's logits, and the pipelined Generator
    raises the backend's `check` where it would have taken them; the plain loop, which reads the step's logits or
    tokens from the device, reads the word beside them (`queue_fail_read`, `failed_check`) and raises too. Every
    token taken is one the model gave."""
    from k3export import runtime as rt
    from k3export.generate import Sampling
    cfg, model = tiny_mla8

    class Failing(rt.EagerBackend):
        post_fail = torch.zeros(1, dtype=torch.int32)
        steps = 0

        def decode(self, ids, conv, rec, cache, lengths):
            self.steps += 1
            out = super().decode(ids, conv, rec, cache, lengths)
            if self.steps > 6:                      # (a launch that gave up: stale logits, the word set)
                self.post_fail[0] = 1
                return (torch.zeros_like(out[0]), *out[1:])
            return out

        def check(self):
            if int(self.post_fail[0]):
                self.post_fail.zero_()
                raise RuntimeError("chain kernel gave up waiting for a filled ring slot")

    s = Sampling(temperature=0.9, top_p=0.8, seed=3) if sampled else Sampling()
    be = Failing(model)
    gen = rt.Generator(rt.Engine(be, 1, 40, cuda_graphs=False), pipeline=pipeline)
    req = gen.submit([3, 1, 4], 30, s)
    with pytest.raises(RuntimeError, match="gave up waiting"):
        gen.run()
    assert 1 <= len(req.tokens) <= 7 and not req.done
    ref = rt.Generator(rt.Engine(rt.EagerBackend(model), 1, 40, cuda_graphs=False)).generate([[3, 1, 4]],
                                                                                             len(req.tokens), s)[0]
    assert req.tokens == ref
