"""The llguidance backend (--structured-outputs-backend guidance): a StructuredOutput
made into llguidance's grammar, and its matcher behind the interface Matchers uses
(xgrammar's: fill a bitmask row, accept a token, roll back, say when the end token
was taken). Both libraries write the same bitmask (32 tokens per int32 word), so
masks are applied the same way whichever backend filled them.

JSON is written as xgrammar writes it (no free whitespace). `grammar` takes Lark
(llguidance's own syntax) or the GBNF / EBNF that xgrammar takes. A structural tag
is xgrammar's format: it is compiled by xgrammar even under this backend
(grammars.py)."""
from __future__ import annotations

import json

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from kvserve.scheduler.structured_output import StructuredOutput

# No free whitespace, and the separators xgrammar's JSON uses (", " and ": "): the
# two backends write the same JSON.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def guidance_grammar(spec: StructuredOutput) -> str:
    """llguidance's grammar for a spec; ValueError saying what is wrong with it."""
    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.spec if spec.kind == "json_schema" else '{"type": "object"}'
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.loads(schema), defaults=COMPACT_JSON)
        elif spec.kind in ("regex", "choice", "grammar"):
            grammar = llguidance.grammar_from(spec.kind, spec.spec)
        else:
            raise ValueError(f"{spec.kind} is not served by the guidance backend")
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {error}")
    return grammar


class GuidanceGrammar:
    """A checked llguidance grammar with the tokenizer it is matched against."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, stop_ids: list[int]):
        self.tokenizer, self.grammar, self.stop_ids = tokenizer, grammar, frozenset(stop_ids)
        self.nbytes = len(grammar)  # its text: matchers build their lexers lazily

    def matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self)


def guidance_tokenizer(hf_tokenizer, vocab_size: int, stop_ids: list[int]):
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                        eos_token=list(stop_ids))


class GuidanceMatcher:
    """An end token is never given to llguidance: once the grammar may end, taking
    one only marks the end here (llguidance does not roll back over an end token
    correctly: its masks after such a rollback allow tokens past the grammar)."""

    def __init__(self, grammar: GuidanceGrammar):
        self._m = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)
        self._stops = grammar.stop_ids
        self._taken = 0  # tokens accepted, the end token included
        self._ended_at: int | None = None  # _taken once the end token was taken

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def accept_token(self, token: int) -> bool:
        """Takes the token if the grammar allows it; a refused one changes nothing
        (llguidance's consume_token would put the matcher in its error state)."""
        if self._ended_at is not None:
            return False
        if token in self._stops:
            if not self._m.is_accepting():
                return False
            self._taken += 1
            self._ended_at = self._taken
            return True
        if self._m.validate_tokens([token]) != 1 or not self._m.consume_token(token):
            return False
        self._taken += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        given = num_tokens
        if self._ended_at is not None and self._ended_at > self._taken - num_tokens:
            self._ended_at, given = None, num_tokens - 1
        if given:
            self._m.rollback(given)
        self._taken -= num_tokens

    def is_terminated(self) -> bool:
        return self._ended_at is not None
