"""Turn each row of logits into a token under that request's sampling parameters.

Greedy rows take the argmax. Random rows use the "exponential race" (argmax of
p / E with E ~ Exp(1)), which samples from p exactly and lets a seeded request draw
its noise from its own generator, so its tokens do not depend on the batch."""
from __future__ import annotations

import torch

from scheduler.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [R, V] float32. Returns [R] int64 token ids."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return tokens
    rows = torch.tensor(random_rows, device=logits.device)
    probs = _probabilities(logits[rows], [params[i] for i in random_rows])
    noise = torch.empty_like(probs)
    for j, i in enumerate(random_rows):
        noise[j].exponential_(generator=generators[i])
    tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens


def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temps.unsqueeze(1)
    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        logits = _apply_top_k(logits, top_ks)
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        logits = _apply_top_p(logits, torch.tensor(top_ps, device=logits.device))
    return logits.softmax(dim=-1)


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (ks - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose mass is at most 1 - p; the top token always survives.
    drop = cumulative <= (1 - top_ps).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
