"""Caps on what a request may ask a grammar to be made of, checked before the spec is
serialised, parsed or compiled: each is a 400 naming the field. The defaults sit
well above what clients send (the tests' and OpenAI's examples are under 2 KB and 5
levels deep) and at or above OpenAI's own limits for strict schemas (10 levels of
object nesting, 5000 properties, 1000 enum values, 128 tools):

- spec bytes (--max-grammar-spec-bytes, 512 KiB): OpenAI's largest strict schema
  (5000 properties) is ~240 KB; xgrammar parses that in 20 ms;
- nesting depth (--max-grammar-spec-depth, 64 levels of objects and arrays; OpenAI's
  10 object levels are ~21-30): xgrammar's parse grows faster than the depth: 12 ms
  at 64 levels, 90 ms at 128, 0.34 s at 200, 50 s at 1000 (a 25 KB schema);
- tools (--max-tools, 128: OpenAI's), choices (--max-guided-choices, 1000: OpenAI's
  enum values; 1000 choices compile in 0.08 s, 10,000 in 0.84 s and 34 MB), regex
  length (--max-regex-length, 16384 characters; RFC 5322's e-mail regex is ~6.4k).

A spec under these caps can still be costly to compile (ten strings of `maxLength`
3000 are 400 bytes and take ~28 s): the engine's --grammar-compile-timeout bounds
that. The walk over a JSON value is iterative (no recursion limit to hit) and stops
as soon as a cap is passed, so what it costs is bounded by the caps themselves."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.server.errors import APIError


@dataclass(frozen=True)
class GrammarLimits:
    spec_bytes: int = 512 << 10  # 0: no limit, for each
    depth: int = 64
    tools: int = 128
    choices: int = 1000
    regex_length: int = 16384

    @classmethod
    def of(cls, config) -> GrammarLimits:
        """From the server's settings (server/config.py)."""
        return cls(config.max_grammar_spec_bytes, config.max_grammar_spec_depth,
                   config.max_tools, config.max_guided_choices, config.max_regex_length)

    def check_text(self, text: str, param: str, what: str) -> None:
        """A grammar, regex or serialised spec given as a string."""
        if self.spec_bytes and _size(text) - 2 > self.spec_bytes:
            self._too_big(param, what)

    def check_regex(self, regex: str, param: str) -> None:
        if self.regex_length and len(regex) > self.regex_length:
            raise APIError(400, f"{param}: a regex may have at most {self.regex_length} "
                           f"characters (--max-regex-length), got {len(regex)}", param)
        self.check_text(regex, param, "regex")

    def check_choices(self, choices: list, param: str) -> None:
        if self.choices and len(choices) > self.choices:
            raise APIError(400, f"{param}: at most {self.choices} choices "
                           f"(--max-guided-choices), got {len(choices)}", param)
        self.check_json(choices, param, "choice list")

    def check_tool_count(self, tools: list) -> None:
        if self.tools and len(tools) > self.tools:
            raise APIError(400, f"at most {self.tools} tools (--max-tools), got "
                           f"{len(tools)}", "tools")

    def check_json_text(self, text: str, param: str, what: str) -> Any:
        """A JSON spec sent as a string: its size, then its value's depth; the value."""
        self.check_text(text, param, what)
        try:
            value = json.loads(text)
        except RecursionError:  # nested past Python's own limit: past ours too
            raise APIError(400, f"{param}: the {what} nests more than {self.depth} "
                           "levels deep (--max-grammar-spec-depth)", param) from None
        except json.JSONDecodeError:
            raise APIError(400, f"{param}: the {what} is not JSON", param) from None
        self.check_json(value, param, what)
        return value

    def check_json(self, value: Any, param: str, what: str, budget: list[int] | None = None
                   ) -> None:
        """A JSON value's size (about its bytes as JSON), nesting and `pattern`s.
        budget: [bytes left], shared by several values that count together (the
        tools' parameters)."""
        left = budget if budget is not None else [self.spec_bytes]
        stack = [(value, 1)]
        while stack:
            item, depth = stack.pop()
            if isinstance(item, (dict, list)):
                if self.depth and depth > self.depth:
                    raise APIError(400, f"{param}: the {what} nests more than {self.depth} "
                                   "levels deep (--max-grammar-spec-depth)", param)
                left[0] -= 2 + len(item)  # brackets and separators
                if isinstance(item, dict):
                    pattern = item.get("pattern")
                    if isinstance(pattern, str):
                        self.check_regex(pattern, param)
                    for key, child in item.items():
                        left[0] -= _size(key) + 1
                        stack.append((child, depth + 1))
                else:
                    stack.extend((child, depth + 1) for child in item)
            else:
                left[0] -= _size(item)
            if self.spec_bytes and left[0] < 0:
                self._too_big(param, what)

    def _too_big(self, param: str, what: str):
        raise APIError(400, f"{param}: the {what} is larger than {self.spec_bytes} bytes "
                       "(--max-grammar-spec-bytes)", param)


def _size(scalar: Any) -> int:
    """About a scalar's bytes as JSON (a string's quotes and UTF-8 bytes; escapes aside)."""
    if isinstance(scalar, str):
        if scalar.isascii():
            return len(scalar) + 2
        return len(scalar.encode("utf-8", "surrogatepass")) + 2
    return len(repr(scalar))
