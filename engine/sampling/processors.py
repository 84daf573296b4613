"""Logits processors: pure tensor functions, each on a [rows, vocab] float block.

Order (vLLM v1): min-tokens mask and bad words, logit_bias, penalties and the
allowed_token_ids mask apply to every row, greedy ones included (greedy is the argmax
after them; the -infs of the masks make their order irrelevant); then temperature, min_p, top-k and
top-p shape the distribution of random rows only."""
from __future__ import annotations

import torch

from kvserve.engine.platform.host_copy import host_tensor_to, to_device

NEG_INF = float("-inf")


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits[rows[i], tokens[i]] = -inf (min_tokens: no EOS or stop token yet)."""
    # A fill, not a copy of the host's -inf (which would wait for the device).
    return logits.index_put((rows, tokens), torch.full((), NEG_INF, device=logits.device))


def add_bias(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
             values: torch.Tensor) -> torch.Tensor:
    """logits[rows[i], tokens[i]] += values[i]."""
    return logits.index_put((rows, tokens), values, accumulate=True)


def token_counts(token_lists: list[list[int]], vocab: int,
                 device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token id occurs in each list."""
    num_rows = len(token_lists)
    counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)
    lens = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    flat = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.long)
    if flat.numel():
        row = torch.repeat_interleave(torch.arange(num_rows), lens)
        index = host_tensor_to(row * vocab + flat, device)
        counts.scatter_add_(0, index, torch.ones(index.shape, device=device))
    return counts.view(num_rows, vocab)


def apply_penalties(logits: torch.Tensor, prompt_seen: torch.Tensor | None,
                    output_counts: torch.Tensor, repetition: torch.Tensor | None,
                    frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """vLLM's order. repetition (HF) over prompt and output tokens: a seen token's
    logit / p when positive, * p otherwise (None: all 1). Then, over output tokens
    only (OpenAI): logit -= frequency * count + presence * (count > 0).
    Per-row values: [R]; prompt_seen (bool) and output_counts: [R, V]."""
    in_output = output_counts > 0
    if repetition is not None:
        seen = in_output if prompt_seen is None else in_output | prompt_seen
        penalty = torch.where(seen, repetition.unsqueeze(1), torch.ones_like(logits))
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return (logits - frequency.unsqueeze(1) * output_counts
            - presence.unsqueeze(1) * in_output.to(logits.dtype))


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=-1)
    floor = min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < floor, NEG_INF)


def apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = to_device([k if 0 < k < vocab else vocab for k in top_ks], torch.long, logits.device)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (ks - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose mass is at most 1 - p; the top token always survives.
    drop = cumulative <= (1 - top_ps).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
