"""Token generation with the eager model: one batched prefill, then decode steps on the explicit state.

Sampling: greedy when temperature == 0, else temperature, then top-k, then top-p (nucleus). Each sequence draws
from its own generator seeded with `Sampling.seed` (`row_generator`, as the runtime's `Generator` does per
request), so a seed reproduces a prompt's tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3export.model import K3Model


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


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """logits `[B, V]` -> token ids `[B]`."""
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if s.top_p < 1.0:
        sp, idx = probs.sort(-1, descending=True)
        drop = sp.cumsum(-1) - sp > s.top_p                     # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, idx, sp.masked_fill(drop, 0.0))
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def row_generator(s: Sampling) -> torch.Generator:
    """The generator one sequence samples from (one per sequence, all seeded alike)."""
    return torch.Generator().manual_seed(s.seed)


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
    gens = [row_generator(sampling) for _ in range(B)]
    logits = model.prefill(ids, state, lengths)
    last = logits[torch.arange(B, device=dev), lengths - 1]                      # [B, V]
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(max_new_tokens):
        if sampling.temperature == 0:
            tok = last.argmax(-1)
        else:                                  # finished rows draw nothing (as a retired request does)
            tok = torch.stack([sample(last[i:i + 1], sampling, gens[i])[0] if not done[i] else last[i].argmax()
                               for i in range(B)])
        for i, t in enumerate(tok.tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = t in stop_tokens
        if all(done) or step == max_new_tokens - 1:
            break
        last = model.decode(tok, state)
    return out
