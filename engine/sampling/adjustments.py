"""The per-step logits adjustments of the rows whose requests ask for any: the
min-tokens mask and bad words (tokens at -inf), logit_bias, penalties, and the
allowed_token_ids mask, built as index and value tensors once per step. Rows that ask
for none are not touched (and a step with none builds nothing).

An allowed_token_ids mask is built on the device once per request (its params) and
kept while they live: a step only stacks the masks of its rows. Bad words cost a
step one dict lookup per request (BadWords.banned: only the sequences whose prefix
can end where the output ends are compared)."""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.engine.platform.host_copy import to_device
from kvserve.engine.sampling.processors import (NEG_INF, add_bias, apply_penalties, ban_tokens,
                                                token_counts)
from kvserve.scheduler.request import Request


@dataclass
class Penalties:
    prompt_seen: torch.Tensor | None  # [P, V] bool, None when no row has repetition
    output_counts: torch.Tensor  # [P, V] float32
    repetition: torch.Tensor | None  # [P], None when all are 1
    frequency: torch.Tensor  # [P]
    presence: torch.Tensor  # [P]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_penalties(logits, self.prompt_seen, self.output_counts,
                               self.repetition, self.frequency, self.presence)


@dataclass
class LogitAdjustments:
    rows: torch.Tensor  # [P] the rows concerned; the pairs below index into them
    bans: tuple[torch.Tensor, torch.Tensor] | None  # (row, token) set to -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token, value)
    penalties: Penalties | None
    # (rows, [len(rows), V] bool, True where a token is not allowed): allowed_token_ids
    disallowed: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A new tensor: `logits` with the adjusted rows replaced."""
        sub = logits.index_select(0, self.rows)
        if self.bans is not None:
            sub = ban_tokens(sub, *self.bans)
        if self.bias is not None:
            sub = add_bias(sub, *self.bias)
        if self.penalties is not None:
            sub = self.penalties.apply(sub)
        if self.disallowed is not None:  # last: -inf stays -inf whatever came before
            rows, mask = self.disallowed
            sub = sub.index_put((rows,), sub.index_select(0, rows).masked_fill(mask, NEG_INF))
        return logits.index_copy(0, self.rows, sub)


def wants_adjustment(req: Request) -> bool:
    p = req.params
    if not p.needs_processing:  # the common case: one attribute read
        return False
    return (p.has_penalties or p.logit_bias is not None or p.allowed_token_ids is not None
            or p.bad_words is not None or req.num_output_tokens < p.min_tokens)


def build_adjustments(seqs: Sequence[Request], vocab: int,
                      device: torch.device) -> LogitAdjustments | None:
    """None when no row needs any adjustment (nothing built, nothing to apply)."""
    picked = [i for i, q in enumerate(seqs) if wants_adjustment(q)]
    if not picked:
        return None
    reqs = [seqs[i] for i in picked]
    return LogitAdjustments(rows=_long(picked, device), bans=_bans(reqs, vocab, device),
                            bias=_bias(reqs, device), penalties=_penalties(reqs, vocab, device),
                            disallowed=_disallowed(reqs, vocab, device))


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device)


def _bans(reqs: list[Request], vocab: int, device: torch.device):
    """(row, token) pairs set to -inf: stop tokens before min_tokens, and bad words."""
    pairs = [(j, t) for j, q in enumerate(reqs) for t in q.banned_stop_ids if 0 <= t < vocab]
    for j, q in enumerate(reqs):
        words = q.params.bad_words
        if words is not None:
            pairs.extend((j, t) for t in words.banned(q.token_ids, q.num_output_tokens)
                         if 0 <= t < vocab)
    if not pairs:
        return None
    rows, tokens = zip(*pairs)
    return _long(list(rows), device), _long(list(tokens), device)


def _bias(reqs: list[Request], device: torch.device):
    triples = [(j, t, b) for j, q in enumerate(reqs)
               for t, b in (q.params.logit_bias or {}).items()]
    if not triples:
        return None
    rows, tokens, values = zip(*triples)
    return _long(list(rows), device), _long(list(tokens), device), _floats(list(values), device)


# (id(allowed_token_ids), device, V) -> [V] bool, True where a token is not allowed.
# Keyed by the list, which a request's n sequences share (their params are copies),
# and dropped when the params that made it are collected (weakref.finalize): those
# hold the list, so no other list can have its id while the entry is there.
_MASKS: dict[tuple[int, torch.device, int], torch.Tensor] = {}


def disallowed_mask(params, vocab: int, device: torch.device) -> torch.Tensor:
    """The request's allowed_token_ids as a [V] bool mask on `device`, made once: at
    most one vocabulary of bools (V bytes) per request, from a host list at most V
    ids long (the server's cap; copying 152k ids to a tensor takes 10-50 ms on CPU,
    once)."""
    key = (id(params.allowed_token_ids), device, vocab)
    mask = _MASKS.get(key)
    if mask is None:
        allowed = [t for t in params.allowed_token_ids if 0 <= t < vocab]
        mask = torch.ones(vocab, dtype=torch.bool, device=device)
        if allowed:
            mask[_long(allowed, device)] = False
        _MASKS[key] = mask
        weakref.finalize(params, _MASKS.pop, key, None)
    return mask


def _disallowed(reqs: list[Request], vocab: int, device: torch.device):
    picked = [j for j, q in enumerate(reqs) if q.params.allowed_token_ids is not None]
    if not picked:
        return None
    masks = [disallowed_mask(reqs[j].params, vocab, device) for j in picked]
    return _long(picked, device), torch.stack(masks)


def _penalties(reqs: list[Request], vocab: int, device: torch.device) -> Penalties | None:
    if not any(q.params.has_penalties for q in reqs):
        return None
    params = [q.params for q in reqs]
    outputs = [q.output_token_ids if p.has_penalties else [] for q, p in zip(reqs, params)]
    repetition = prompt_seen = None
    if any(p.repetition_penalty != 1.0 for p in params):
        repetition = _floats([p.repetition_penalty for p in params], device)
        prompts = [q.token_ids[:q.num_prompt_tokens] if p.repetition_penalty != 1.0 else []
                   for q, p in zip(reqs, params)]
        prompt_seen = token_counts(prompts, vocab, device) > 0
    return Penalties(prompt_seen, token_counts(outputs, vocab, device), repetition,
                     _floats([p.frequency_penalty for p in params], device),
                     _floats([p.presence_penalty for p in params], device))
