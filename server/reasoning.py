"""--reasoning-parser: a thinking model's `<think>...</think>` split from its answer,
into `reasoning_content` (chat) and reasoning items (Responses).

One incremental splitter serves whole bodies and streams alike (a whole body is the
stream fed at once), so a streamed answer always concatenates to the whole one, with
a tag cut anywhere across tokens held back until it is whole or ruled out.

Where the reasoning starts is read off the prompt, not guessed from the output:
- deepseek_r1: the output starts inside the reasoning (R1 does not write `<think>`;
  R1-0528 does, and a leading one is dropped).
- qwen3: the output starts inside the reasoning when the rendered prompt ends with an
  open `<think>` (Qwen3 thinking-2507 templates put it there); otherwise only an
  output that opens with `<think>` reasons. With `enable_thinking: false` the template
  writes an empty `<think></think>` itself and the output is all answer.
An output that stops inside the reasoning (max_tokens) is all reasoning, streamed or
not; the answer after `</think>` starts at its first non-space character."""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")
PARSER_CHOICES = ("none", *PARSERS)

_OPENING, _THINKING_START, _THINKING, _ANSWER_START, _ANSWER = range(5)


@dataclass(frozen=True)
class ReasoningParser:
    name: str

    def opens_thinking(self, prompt_text: str | None) -> bool:
        """Whether the output begins inside the reasoning, given the rendered prompt."""
        if self.name == "deepseek_r1":
            return True
        text = (prompt_text or "").rstrip()
        return text.endswith(START) and not text.endswith(END)

    def stream(self, prompt_text: str | None, constrained: bool = False) -> ReasoningStream:
        """constrained: the output is held to a grammar from its first token (a
        structured output, a forced tool call), so it has no room to think: all answer."""
        if constrained:
            return ReasoningStream(False, answer_only=True)
        return ReasoningStream(self.opens_thinking(prompt_text))

    def split(self, text: str, prompt_text: str | None) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a whole output; None for an empty part."""
        return self.stream(prompt_text).whole(text)


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if not name or name == "none":
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {PARSERS}")
    return ReasoningParser(name)


class ReasoningStream:
    """feed(text) -> (reasoning, answer): what is final so far; finish() the rest."""

    def __init__(self, thinking: bool, answer_only: bool = False):
        # Before anything: an opening <think> may come (dropped, or the start of
        # reasoning); inside: everything up to </think> is reasoning.
        self._state = _ANSWER if answer_only else _OPENING
        self._thinking_first = thinking
        self._held = ""  # text that may be the start of a tag

    @property
    def in_reasoning(self) -> bool:
        return self._state in (_THINKING_START, _THINKING) or (
            self._state == _OPENING and self._thinking_first)

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning = answer = ""
        while text:
            if self._state == _OPENING:
                body = text.lstrip()
                if body.startswith(START):
                    self._state, text = _THINKING_START, body[len(START):]
                elif START.startswith(body):  # maybe a tag still arriving
                    self._held = text
                    return reasoning, answer
                else:
                    self._state = _THINKING if self._thinking_first else _ANSWER_START
            elif self._state == _THINKING:
                before, found, after = text.partition(END)
                if found:
                    reasoning += before
                    self._state, text = _ANSWER_START, after
                    continue
                keep = _partial_tag_len(text, END)
                reasoning += text[:len(text) - keep]
                self._held = text[len(text) - keep:]
                return reasoning, answer
            elif self._state in (_THINKING_START, _ANSWER_START):
                text = text.lstrip()  # either starts at its first character
                if text:
                    self._state = _THINKING if self._state == _THINKING_START else _ANSWER
            else:
                answer += text
                text = ""
        return reasoning, answer

    def whole(self, text: str) -> tuple[str | None, str | None]:
        """A whole output at once: (reasoning, answer), None for an empty part."""
        reasoning, answer = self.feed(text)
        more_reasoning, more_answer = self.finish()
        return (reasoning + more_reasoning) or None, (answer + more_answer) or None

    def finish(self) -> tuple[str, str]:
        """What was held back: a tag that never completed is plain text again."""
        held, self._held = self._held, ""  # only ever held at the opening or in thought
        return (held, "") if self.in_reasoning else ("", held.lstrip())


def _partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
