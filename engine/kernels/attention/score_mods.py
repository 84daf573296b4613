"""What some families change in attention beyond the causal softmax, for the
reference paths (torch ops): a sliding window (a query at position p sees keys in
(p - window, p], as transformers' sliding masks do), logit soft-capping
(cap * tanh(score / cap), Gemma 2), and attention sinks (one learned logit per
query head that joins every softmax's denominator and adds no value, gpt-oss).
window 0, softcap 0.0 and sinks None mean plain attention; kvserve's CPU kernels
run only that, so a layer with any of them takes these paths."""
from __future__ import annotations

import torch


def plain(window: int, softcap: float, sinks: torch.Tensor | None) -> bool:
    return not window and not softcap and sinks is None


def in_window(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """True where a key is inside the query's window (broadcasting the two)."""
    return key_pos > query_pos - window


def capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(scores / softcap) * softcap if softcap else scores


def softmax(scores: torch.Tensor, dim: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax along `dim`, masked scores being -inf; with `sinks` (broadcast to
    scores without `dim`), each sink's exp joins the denominator."""
    if sinks is None:
        return scores.softmax(dim=dim)
    top = torch.maximum(scores.amax(dim=dim), sinks).unsqueeze(dim)
    p = (scores - top).exp()
    return p / (p.sum(dim=dim, keepdim=True) + (sinks.unsqueeze(dim) - top).exp())


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 visible: torch.Tensor, scale: float, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention written out, for what SDPA cannot do (soft-capping, sinks):
    q [B, H, Q, D]; k, v [B, Hkv, L, D]; visible: bool, broadcastable to
    [B, H, Q, L]; sinks [H]. Scores and softmax in float32. -> [B, H, Q, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = capped(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale, softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = None if sinks is None else sinks.float().reshape(1, -1, 1).expand(
        scores.shape[0], -1, scores.shape[2])
    p = softmax(scores, -1, sink)
    return torch.matmul(p.to(v.dtype), v)
