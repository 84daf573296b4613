"""Incremental detokenization with stop strings.

Tokens are decoded in a small sliding window (a few tokens of context before the new
ones), so the cost per step does not grow with the output, and text is released only
once it is final: a window ending in U+FFFD is an incomplete multi-byte character and
waits for the next token. Stop strings are searched only where a new match can start,
and a streaming caller is never handed characters that might still turn out to be the
beginning of a stop string. All of a request's stop strings are searched for in one
pass of one compiled pattern (at most --max-stop-strings of them, each at most
MAX_STOP_CHARS long: the search runs on the event loop, for every token)."""
from __future__ import annotations

import re

MAX_STOP_CHARS = 256  # a stop string's longest (server/service.py refuses longer ones)
_CONTEXT_TOKENS = 5  # earlier tokens kept so a word boundary decodes the same way


def fast_decoder(tokenizer):
    """(ids, skip_special_tokens) -> text. Straight to the Rust tokenizer when that
    gives the same text as transformers' decode (no clean-up of spaces): the Python
    wrapper costs more than the decoding itself, twice per streamed token."""
    if tokenizer is None:  # a model without one: token ids only, no text
        return lambda ids, skip: ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self._decode_ids = fast_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        # Leftmost match first; at one position, the first listed stop that matches.
        self._stops = re.compile("|".join(map(re.escape, self.stop))) if self.stop else None
        self.text = ""  # all output text so far (cut at a stop string once matched)
        self.sent = 0  # characters of self.text already handed out
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> None:
        """Append tokens; sets stop_reason if a stop string now appears."""
        for tok in token_ids:
            if self.stop_reason is not None:
                return
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if full.endswith("\ufffd") or len(full) <= len(prefix):
                continue  # an incomplete character, or nothing visible yet
            old_len = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        """A stop string that ends in the text added since old_len (one wholly before
        it was looked for when that text was added)."""
        if self._stops is None:
            return
        found = self._stops.search(self.text, max(0, old_len - self.hold_back))
        if found is not None:
            i, s = found.start(), found.group()
            self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
            self.stop_reason = s

    def _release_pending(self) -> None:
        # At the end an incomplete character is final too: send what it decodes to.
        if self.stop_reason is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            old_len = len(self.text)
            self.text += full[len(prefix):]
            self.read_offset = len(self.ids)
            self._check_stop(old_len)

    def flush(self, finished: bool) -> str:
        """The text that is safe to send now (everything, once finished)."""
        if finished:
            self._release_pending()
        end = len(self.text) if finished or self.stop_reason else max(
            self.sent, len(self.text) - self.hold_back)
        delta, self.sent = self.text[self.sent:end], end
        return delta
