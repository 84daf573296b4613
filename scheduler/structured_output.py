"""What a request's output must match, as the request said it (pure Python: it
travels with SamplingParams from the front end to the engine, which compiles it into
a token-level grammar: engine/structured/)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar",
                          "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """kind and its text: a JSON schema (serialised), a regex, a JSON list of the
    choices, an EBNF grammar, an xgrammar structural tag (serialised: free text with
    constrained regions, e.g. tool calls between their tags), or "" for any JSON
    object. Hashable: the engine caches
    compiled grammars by it."""
    kind: Kind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}")
