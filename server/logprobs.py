"""Engine logprobs (token ids, floats) -> the two OpenAI wire shapes.

Token strings are each id decoded on its own with special tokens kept, as vLLM does.
-inf (a token made impossible, e.g. by logit_bias) is sent as -9999.0 because JSON
has no infinity."""
from __future__ import annotations

import math

from kvserve.server.detokenizer import fast_decoder

_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, _FLOOR) if not math.isnan(logprob) else _FLOOR


class TokenText:
    """Caches id -> text, since the same ids recur in top-k lists."""

    def __init__(self, tokenizer):
        self._decode = fast_decoder(tokenizer)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._decode([token_id], False)
            self._cache[token_id] = text
        return text


def completion_logprobs(entries: list, token_text: TokenText, text_offset: int) -> dict:
    """/v1/completions: parallel lists. `entries` are TokenLogprobs, or None for a
    position without one (the first prompt token under echo)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        if e is None:
            continue
        text = token_text(e.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(e.logprob))
        top = {token_text(t): _finite(lp) for t, lp in e.top}
        top.setdefault(text, _finite(e.logprob))  # the chosen token is always listed
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def prompt_completion_logprobs(prompt_ids: list[int], entries: list, token_text: TokenText,
                               num_top: int) -> dict:
    """Echoed prompt tokens: the first has no logprob (nothing precedes it). num_top:
    the request's logprobs (the engine's lists may be longer, for prompt_logprobs)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token_id, e in zip(prompt_ids, entries):
        text = token_text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if e is None else _finite(e.logprob))
        top = None if e is None else {token_text(t): _finite(lp)
                                      for t, lp in e.top[:num_top]}
        if top is not None:
            top.setdefault(text, _finite(e.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def vllm_prompt_logprobs(entries: list | None, token_text: TokenText,
                         num_top: int | None) -> list | None:
    """vLLM's prompt_logprobs: None for the first prompt token (nothing precedes it),
    then per token {token id: {logprob, rank, decoded_token}}: the prompt's own token,
    then the num_top most likely (None: every one listed) ranked 1..num_top. A token
    that is both keeps the first place and takes its top-list rank, as in vLLM's dict.
    None: the engine sent no lists (the request ended before its first token)."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = [(e.token_id, e.logprob, e.rank),
                  *((t, lp, r) for r, (t, lp) in enumerate(e.top[:num_top], 1))]
        out.append({str(t): {"logprob": _finite(lp), "rank": r,
                             "decoded_token": token_text(t)} for t, lp, r in ranked})
    return out


def merge_completion_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(entries: list, token_text: TokenText, num_top: int) -> dict:
    """/v1/chat/completions: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": _finite(logprob),
                "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        entry = item(e.token_id, e.logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in e.top[:num_top]]
        content.append(entry)
    return {"content": content}
