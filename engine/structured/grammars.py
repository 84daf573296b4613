"""StructuredOutput -> a grammar over the vocabulary, by the backend's library:
xgrammar (the default) or llguidance (guidance.py). `check` needs no tokenizer and
is cheap (the front end calls it, off its event loop, to refuse a bad schema, regex
or grammar with a 400 before anything is scheduled); compiling adds the tokenizer's
vocabulary (for xgrammar the costly part: ~0.2 s for a JSON schema against a 49k
vocabulary on 2 cores), on the compiler's thread under a deadline (compiler.py), and
the last compiled grammars are kept (grammar_cache.py). Either backend's grammar
makes the matchers of its sequences (`matcher()`), which Matchers drives through
xgrammar's matcher interface.

JSON is compact (no free whitespace between tokens): a small model sampling at
temperature 1 otherwise wanders into whitespace until it runs out of tokens."""
from __future__ import annotations

import json
from typing import Protocol

import torch
import xgrammar as xgr

from kvserve.scheduler.structured_output import StructuredOutput


class Matcher(Protocol):
    """One sequence's grammar state: xgrammar's GrammarMatcher, or an adapter."""
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...
    def accept_token(self, token: int) -> bool: ...  # False: refused, state unchanged
    def rollback(self, num_tokens: int) -> None: ...
    def is_terminated(self) -> bool: ...  # an end token was taken


class Grammar(Protocol):
    nbytes: int  # about what it holds in memory (what the cache charges it)

    def matcher(self) -> Matcher: ...


class XgrammarGrammar:
    def __init__(self, compiled: xgr.CompiledGrammar):
        self.compiled = compiled
        self.nbytes = compiled.memory_size_bytes  # xgrammar's own estimate

    def matcher(self) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compiled)


def check(spec: StructuredOutput, backend: str = "xgrammar") -> None:
    """ValueError saying what is wrong with a spec the backend cannot serve."""
    if uses_guidance(spec, backend):
        from kvserve.engine.structured.guidance import guidance_grammar
        guidance_grammar(spec)
    else:
        parse(spec)


def uses_guidance(spec: StructuredOutput, backend: str) -> bool:
    """Structural tags are xgrammar's format: xgrammar serves them under either."""
    return backend == "guidance" and spec.kind != "structural_tag"


def parse(spec: StructuredOutput) -> xgr.Grammar:
    """The grammar a spec stands for; ValueError saying what is wrong with it."""
    try:
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False,
                                                strict_mode=True)
        if spec.kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.spec)))
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.spec)
        return xgr.Grammar.from_ebnf(spec.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {_reason(exc)}") from None


def choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ..., each choice a literal (JSON's escapes are EBNF's)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice must be a list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its source location prefix ("[time] file:line: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
