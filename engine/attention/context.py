"""One global attention context per forward pass (as nano-vllm does), so the model
code does not thread batch metadata through every layer. The model runner builds it
once per step; every attention layer reads it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """A request computing more than one token this step (a prompt or a chunk of it)."""

    query_start: int  # first row of this request in the flat batch
    query_len: int
    context_slots: torch.Tensor  # [context_len] cache slots of the whole context, in order
    mask: torch.Tensor | None  # [query_len, context_len] bool, None when plain causal


@dataclass
class DecodeBatch:
    """Requests computing exactly one token this step, attended to in one padded call."""

    rows: torch.Tensor  # [B] rows of these requests in the flat batch
    context_slots: torch.Tensor  # [B, max_context_len] cache slots, padded with 0
    mask: torch.Tensor  # [B, 1, 1, max_context_len] bool: True where a real key is


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    prefills: list[PrefillSpan]
    decodes: DecodeBatch | None
    num_tokens: int


_current: AttentionMetadata | None = None


def set_attention_metadata(meta: AttentionMetadata | None) -> None:
    global _current
    _current = meta


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention called outside a model runner step")
    return _current
