"""StructuredOutput -> a grammar over the vocabulary, by the backend's library:
xgrammar (the default) or llguidance (guidance.py). `check` needs no tokenizer and
is cheap (the front end calls it to refuse a bad schema, regex or grammar with a 400
before anything is scheduled); `GrammarCompiler` adds the tokenizer's vocabulary
(for xgrammar the costly part: ~0.2 s for a JSON schema against a 49k vocabulary on
2 cores), on a thread of its own so steps go on meanwhile, and keeps the last
compiled grammars. Either backend's grammar makes the matchers of its sequences
(`matcher()`), which Matchers drives through xgrammar's matcher interface.

JSON is compact (no free whitespace between tokens): a small model sampling at
temperature 1 otherwise wanders into whitespace until it runs out of tokens."""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
import xgrammar as xgr

from scheduler.structured_output import StructuredOutput

CACHED_GRAMMARS = 64  # compiled grammars kept (each ~1-2 MB for a JSON schema)


class Matcher(Protocol):
    """One sequence's grammar state: xgrammar's GrammarMatcher, or an adapter."""
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...
    def accept_token(self, token: int) -> bool: ...  # False: refused, state unchanged
    def rollback(self, num_tokens: int) -> None: ...
    def is_terminated(self) -> bool: ...  # an end token was taken


class Grammar(Protocol):
    def matcher(self) -> Matcher: ...


class XgrammarGrammar:
    def __init__(self, compiled: xgr.CompiledGrammar):
        self.compiled = compiled

    def matcher(self) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compiled)


def check(spec: StructuredOutput, backend: str = "xgrammar") -> None:
    """ValueError saying what is wrong with a spec the backend cannot serve."""
    if _uses_guidance(spec, backend):
        from engine.structured.guidance import guidance_grammar
        guidance_grammar(spec)
    else:
        parse(spec)


def _uses_guidance(spec: StructuredOutput, backend: str) -> bool:
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


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 backend: str = "xgrammar"):
        # The model's own end tokens end a grammar (the tokenizer's may differ).
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._backend, self._stops = backend, list(stop_token_ids)
        self._guidance_tokenizer = None
        if backend == "guidance":
            from engine.structured.guidance import guidance_tokenizer
            self._guidance_tokenizer = guidance_tokenizer(tokenizer, vocab_size, self._stops)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
        self._cache: OrderedDict[StructuredOutput, Grammar] = OrderedDict()
        self._compiling: dict[StructuredOutput, Future] = {}  # one compile per spec
        self._lock = threading.Lock()
        self._compile_seconds: list[float] = []  # since take_compile_seconds

    def submit(self, spec: StructuredOutput) -> Future:
        """The compiled grammar: now if cached, else when the compiler thread has it
        (requests arriving with the same spec while it compiles share the one job)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                done: Future = Future()
                done.set_result(hit)
                return done
            job = self._compiling.get(spec)
            if job is None:
                job = self._compiling[spec] = self._pool.submit(self._compile, spec)
            return job

    def take_compile_seconds(self) -> list[float]:
        """How long each compile finished since the last call took (for metrics)."""
        with self._lock:
            taken, self._compile_seconds = self._compile_seconds, []
        return taken

    def _compile(self, spec: StructuredOutput) -> Grammar:
        t0 = time.perf_counter()
        try:
            if _uses_guidance(spec, self._backend):
                from engine.structured.guidance import GuidanceGrammar, guidance_grammar
                compiled = GuidanceGrammar(self._guidance_tokenizer, guidance_grammar(spec),
                                           self._stops)
            else:
                compiled = XgrammarGrammar(self._compiler.compile_grammar(parse(spec)))
        except BaseException:
            with self._lock:
                self._compiling.pop(spec, None)
            raise
        with self._lock:  # cached in the same breath as it stops being compiled
            self._compiling.pop(spec, None)
            self._compile_seconds.append(time.perf_counter() - t0)
            self._cache[spec] = compiled
            if len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled
