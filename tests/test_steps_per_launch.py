"""Several greedy decode steps in one program (`Engine.decode_greedy_steps`, the Generator's bursts): the engine side
of the megakernel's STEP_LOOP launch, on CPU with a stand-in backend that runs the steps one after another the way
the launch does (each step's argmax fed to the next, its token posted to the host ring's next row, the lengths and
MLA rows moved in the program). The launch itself is checked against single launches on the GPU
(tests/test_megakernel_backend.py, `cuda`)."""

from __future__ import annotations

import pytest
import torch

from k3export import runtime as rt
from k3export.generate import Sampling
from k3export.sampling import post_reference


def looping_backend(model, k: int):
    """An eager backend that takes the argmax, commits the lengths and runs up to k greedy steps a `decode_`."""

    class Looping(rt.EagerBackend):
        takes_argmax = True
        commits_lengths = True
        steps_per_launch = k
        calls: list[int] = []

        def decode_(self, ids, conv, rec, cache, lengths, argmax=None, active=None, steps=1):
            assert steps == 1 or (argmax is not None and active is not None)
            self.calls.append(steps)
            for _ in range(steps):
                logits, rows = model.forward_decode_(ids, conv, rec, cache, lengths)
                n_mla, B, _, R = cache.shape
                pos = lengths.clamp(max=cache.shape[2] - 1).view(1, B, 1, 1).expand(n_mla, B, 1, R)
                cache.scatter_(2, pos, rows.to(cache.dtype))
                if argmax is not None:
                    out, ring, _ = argmax
                    out.copy_(logits.argmax(-1))        # (the engine's ids buffer: the next step's input)
                    if ring is not None:
                        post_reference((ring, lengths + active), out)
                lengths.add_(active)
            return logits, None

    return Looping(model)


def test_a_program_of_several_steps_equals_as_many_single_steps(tiny_mla8):
    """`decode_greedy_steps(k)` after a prefill: the same tokens (each step's, from the host ring), lengths, state
    and last logits as k `decode_greedy` calls; k past the backend's `steps_per_launch`, or past a slot's max_len,
    is refused before anything runs."""
    cfg, model = tiny_mla8
    runs = []
    for burst in (False, True):
        eng = rt.Engine(looping_backend(model, 4), 1, 16, cuda_graphs=False)
        assert eng.steps_per_launch == 4
        first = int(eng.prefill([0], [[3, 1, 4, 1, 5]])[0].argmax())
        toks = []
        ids = torch.tensor([first])
        for _ in range(2):
            if burst:
                eng.decode_greedy_steps(4, ids)
                toks += [row[0] for row in eng.posted_steps(eng.post_mark(), 4)]
            else:
                for j in range(4):
                    eng.decode_greedy(ids if j == 0 else None)
                    toks.append(eng.posted(eng.post_mark())[0])
            ids = None
        assert eng.state.lengths.tolist() == [13] == eng._host_lengths
        runs.append((toks, eng.last_logits.clone(), eng.state.kda_state.clone(), eng.state.mla_cache.clone()))
        if burst:
            with pytest.raises(ValueError, match="steps is 1..4"):
                eng.decode_greedy_steps(5)
            with pytest.raises(ValueError, match="full"):
                eng.decode_greedy_steps(4)              # rows 13..16 of 16
            assert eng.state.lengths.tolist() == [13] == eng._host_lengths
            eng.decode_greedy_steps(3)                  # rows 13..15: the last ones
            assert eng._host_lengths == [16]
    (t0, l0, s0, c0), (t1, l1, s1, c1) = runs
    assert t0 == t1 and torch.equal(l0, l1) and torch.equal(s0, s1) and torch.equal(c0, c1)
    assert t0[0] == int(model(torch.tensor([[3, 1, 4, 1, 5, first]]))[0, -1].argmax())


def test_the_generator_runs_bursts_and_gives_the_plain_loops_tokens(tiny_mla8):
    """The pipelined Generator over a backend of 4 steps a program: bursts while every request has room for 4 more
    tokens, single steps at the end (max_new_tokens not a multiple of 4), a stop token inside a burst (the later
    steps' tokens dropped), requests queued behind a full batch: the tokens of the plain loop on eager. Sampled
    requests run single steps. steps_per_launch=1 turns bursts off; more than the engine's is refused."""
    cfg, model = tiny_mla8
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    ref = rt.Engine(rt.EagerBackend(model), 2, 32, cuda_graphs=False)
    want = rt.Generator(ref, pipeline=False).generate(prompts, 11)
    stop = want[0][5]                                 # (inside request 0's second burst: tokens 5..8)
    want_stop = rt.Generator(ref, pipeline=False).generate(prompts, 11, stop_tokens=(stop,))
    assert len(want_stop[0]) == 6 < len(want[0])
    sampled = Sampling(temperature=0.8, top_p=0.9, seed=3)
    want_sampled = rt.Generator(ref, pipeline=False).generate(prompts, 7, sampled)
    for max_batch in (1, 2):
        be = looping_backend(model, 4)
        eng = rt.Engine(be, max_batch, 32, cuda_graphs=False)
        gen = rt.Generator(eng)
        assert gen.steps_per_launch == 4
        be.calls.clear()
        assert gen.generate(prompts, 11) == want, max_batch
        assert 4 in be.calls and 1 in be.calls
        assert rt.Generator(eng).generate(prompts, 11, stop_tokens=(stop,)) == want_stop, max_batch
        be.calls.clear()
        assert rt.Generator(eng).generate(prompts, 7, sampled) == want_sampled, max_batch
        assert set(be.calls) == {1}
        be.calls.clear()
        assert rt.Generator(eng, steps_per_launch=1).generate(prompts, 11) == want
        assert set(be.calls) == {1}
        with pytest.raises(ValueError, match="steps_per_launch is 1..4"):
            rt.Generator(eng, steps_per_launch=5)


def test_an_engine_whose_backend_runs_one_step_refuses_several(tiny_mla8):
    cfg, model = tiny_mla8
    eng = rt.Engine(rt.EagerBackend(model), 1, 16, cuda_graphs=False)
    assert eng.steps_per_launch == 1 and rt.Generator(eng).steps_per_launch == 1
    eng.prefill([0], [[1, 2]])
    with pytest.raises(ValueError, match="steps is 1..1"):
        eng.decode_greedy_steps(2)


@pytest.mark.parametrize("k", [4, 1])
def test_a_program_that_stops_short_is_caught_before_its_stale_tokens_are_taken(tiny_mla8, k):
    """A decode program that ends without posting its tokens (the megakernel's launch that gave up waiting: its rows
    of the host ring would hold an earlier step's tokens) is caught where the pipelined Generator reads them, bursts
    of k steps or single steps: the engine clears a step's rows before queueing it, finds them still clear, and
    lets the backend's `check` name the failure (else says the program did not run to its end). No request takes a
    token of the failed program."""
    cfg, model = tiny_mla8
    for with_check in (True, False):
        be = looping_backend(model, k)
        decode_ = be.decode_
        good = 5                                    # programs that run; the next ones post nothing

        def failing(ids, conv, rec, cache, lengths, argmax=None, active=None, steps=1):
            if len(be.calls) >= good:
                be.calls.append(-steps)
                return torch.zeros(ids.shape[0], cfg.vocab_size), None
            return decode_(ids, conv, rec, cache, lengths, argmax=argmax, active=active, steps=steps)
        be.decode_ = failing
        if with_check:
            def check():
                if any(c < 0 for c in be.calls):
                    raise RuntimeError("chain kernel gave up waiting for the top-k's words")
            be.check = check
        eng = rt.Engine(be, 1, 64, cuda_graphs=False)
        gen = rt.Generator(eng)
        req = gen.submit([3, 1, 4, 1, 5], 40)
        with pytest.raises(RuntimeError, match="gave up waiting" if with_check else "did not run to its end"):
            gen.run()
        ran = sum(c for c in be.calls if c > 0)      # (steps of the programs that ran: the first one is single)
        assert ran >= good and len(req.tokens) == 1 + ran and not req.done, (len(req.tokens), be.calls)
        ref = rt.Generator(rt.Engine(looping_backend(model, k), 1, 64, cuda_graphs=False)).generate(
            [[3, 1, 4, 1, 5]], 1 + ran)[0]
        assert req.tokens == ref                    # (every token taken is a program's that ran)
