"""Token generation with the eager model: one batched prefill, then decode steps on the explicit state.

Sampling: greedy when temperature == 0, else temperature, then top-k, then top-p (nucleus), drawn by
`k3export.sampling.draw` from noise keyed by (seed, the sequence's length), as the runtime's `Generator` draws a
request's tokens, so a seed reproduces a prompt's tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3export.model import K3Model
from k3export.sampling import draw, sort_width


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1.0: off
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")


def sampling_rows(samplings: list[Sampling], device) -> tuple[torch.Tensor, ...]:
    """Per-row tensors (temperature, top_k, top_p, seed) for `k3export.sampling.draw`."""
    return (torch.tensor([s.temperature for s in samplings], dtype=torch.float32, device=device),
            torch.tensor([s.top_k for s in samplings], dtype=torch.int64, device=device),
            torch.tensor([s.top_p for s in samplings], dtype=torch.float32, device=device),
            torch.tensor([s.seed for s in samplings], dtype=torch.int64, device=device))


def filtered(samplings: list[Sampling]) -> bool:
    """Whether any row samples with top-k or top-p (the draw then sorts each row's logits)."""
    return any(s.temperature and (s.top_k or s.top_p < 1.0) for s in samplings)


def width(samplings: list[Sampling], vocab: int) -> int | None:
    """How many of each row's largest logits the draw's filters need (`k3export.sampling.sort_width` over the
    sampled rows: a top-k of that many instead of a full sort when every filtered row sets top_k)."""
    rows = [s for s in samplings if s.temperature]
    return sort_width([s.top_k for s in rows], [s.top_p for s in rows], vocab)


def sample(logits: torch.Tensor, samplings: list[Sampling], counter: torch.Tensor) -> torch.Tensor:
    """logits `[B, V]`, one `Sampling` a row, each row's counter `[B]` (the sequence's length: prompt + tokens so
    far) -> token ids `[B]` (`k3export.sampling.draw`)."""
    if all(s.temperature == 0 for s in samplings):
        return logits.argmax(-1)
    return draw(logits, *sampling_rows(samplings, logits.device), counter.to(logits.device),
                filtered=filtered(samplings), width=width(samplings, logits.shape[1]))


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")


@torch.no_grad()
def generate(model: K3Model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
             stop_tokens: tuple[int, ...] = ()) -> list[list[int]]:
    """Generate up to `max_new_tokens` per prompt (prompts may differ in length). A sequence stops at its
    first stop token (kept in the output). Returns the new tokens per prompt."""
    check_prompts(prompts, model.config.vocab_size)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    B, T = len(prompts), max(len(p) for p in prompts)
    dev = model.device
    ids = torch.zeros(B, T, dtype=torch.int64, device=dev)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    state = model.new_state(B, T + max_new_tokens)
    logits = model.prefill(ids, state, lengths)
    last = logits[torch.arange(B, device=dev), lengths - 1]                      # [B, V]
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(max_new_tokens):
        tok = sample(last, [sampling] * B, lengths + step)      # (finished rows' draws are not used)
        for i, t in enumerate(tok.tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = t in stop_tokens
        if all(done) or step == max_new_tokens - 1:
            break
        last = model.decode(tok, state)
    return out
